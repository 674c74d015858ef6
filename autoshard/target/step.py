"""One training step's inputs and loss, for whatever model a target builds.

The example batch comes, in order, from the target (a factory returning ``(model, batch)``), the
model's ``example_input_array`` (as Lightning modules define it), or, for token models, random
token ids of ``micro_batch_size x seq_len`` below the vocabulary size.

How a batch is fed: a dict as keyword arguments (``model(**batch)``), a tuple or list as positional
arguments, anything else as the single argument.

The loss, in order: a function ``autoshard_loss(output, batch)`` defined in the target's module
(the way to supply your own), the output's ``.loss`` (Hugging Face models, given ``labels``), a
dict's ``"loss"``, a scalar output, next-token cross-entropy for ``[B, T, V]`` logits of a token
batch, cross-entropy for ``[N, C]`` scores against integer targets in the batch, and otherwise the
mean of the output (enough to time a backward pass through every parameter).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.errors import ConfigError

LossFn = Callable[[Any, Any], torch.Tensor]


def find_vocab_size(model: nn.Module) -> int | None:
    """Rows of the largest embedding, or a ``vocab_size`` attribute (model or its config)."""
    for holder in (model, getattr(model, "config", None)):
        size = getattr(holder, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        return max(embeddings, key=lambda m: m.weight.numel()).num_embeddings
    return None


def make_batch(
    model: nn.Module,
    built_batch: Any | None,
    *,
    micro_batch_size: int,
    seq_len: int | None,
    device: torch.device,
    seed: int = 0,
    data: Any | None = None,
) -> Any:
    """The example batch for one step on ``device``, of ``micro_batch_size`` samples.

    From the user's data (``data``: a :class:`~autoshard.target.data.BatchSource`) it is a real
    batch drawn through the loader at the micro-batch size (or cut or repeated from its first
    batch where the loader's size is fixed).

    A batch from the target keeps its contents and shapes but is cut or repeated to the
    micro-batch (:func:`resize_batch`), as the estimators count it per sample: otherwise a
    trial or a simulation labelled micro-batch 4 would run the target's 2 samples. Token batches
    are synthesised at ``micro_batch_size x seq_len``.
    """
    if data is not None:
        return move_to(data.batch(micro_batch_size), device)
    if built_batch is not None:
        return move_to(resize_batch(built_batch, micro_batch_size), device)
    vocab = find_vocab_size(model)
    if vocab is None or seq_len is None:
        raise ConfigError(
            "no example batch: the target returns no (model, batch) and the model has no "
            "example_input_array; give --seq-len for a token model, or return a batch from "
            "the factory"
        )
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (micro_batch_size, seq_len), generator=generator)
    return ids.to(device)


def resize_batch(batch: Any, samples: int) -> Any:
    """``batch`` with ``samples`` samples: every tensor whose leading dimension is the batch's
    sample count (:func:`batch_samples`) is cut to its first ``samples`` rows or repeated until
    it has them; everything else is kept as it is.

    >>> import torch
    >>> batch = {"input_ids": torch.arange(6).reshape(2, 3), "scale": torch.tensor(1.0)}
    >>> resize_batch(batch, 3)["input_ids"].tolist(), resize_batch(batch, 1)["input_ids"].shape
    ([[0, 1, 2], [3, 4, 5], [0, 1, 2]], torch.Size([1, 3]))
    """
    have = batch_samples(batch)
    if samples == have:
        return batch

    def resize(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != have:
                return value
            repeats = -(-samples // have)
            return value.repeat(repeats, *([1] * (value.dim() - 1)))[:samples]
        if isinstance(value, dict):
            return {k: resize(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(resize(v) for v in value)
        return value

    return resize(batch)


def move_to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def batch_samples(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch
    if isinstance(values, list | tuple) or hasattr(values, "__iter__"):
        for v in values:
            if isinstance(v, torch.Tensor) and v.dim():
                return int(v.shape[0])
    return 1


def batch_tokens(batch: Any) -> int | None:
    """Tokens in a batch of integer ids ([B, T]), or None when it is not a token batch."""
    first = batch
    if isinstance(batch, dict):
        first = batch.get("input_ids")
    elif isinstance(batch, list | tuple) and batch:
        first = batch[0]
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.numel())
    return None


def with_labels(model: nn.Module, batch: Any) -> Any:
    """Hugging Face style: add ``labels`` (the input ids) when forward takes them."""
    if not isinstance(batch, dict) or "labels" in batch or "input_ids" not in batch:
        return batch
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return batch
    return {**batch, "labels": batch["input_ids"]} if "labels" in params else batch


def forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, list | tuple):
        return model(*batch)
    return model(batch)


def compute_loss(output: Any, batch: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
    """A scalar loss from a model output, following the order in the module docstring."""
    if loss_fn is not None:
        return loss_fn(output, batch)
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        output = output[0]
    logits = getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(
            f"cannot compute a loss from a {type(output).__name__} output; define "
            "autoshard_loss(output, batch) in the target's module"
        )
    if logits.dim() == 0:
        return logits
    ids = batch if isinstance(batch, torch.Tensor) else None
    if isinstance(batch, dict):
        ids = batch.get("input_ids")
    if (
        ids is not None
        and logits.dim() == 3
        and ids.dim() == 2
        and logits.shape[:2] == ids.shape
        and not ids.is_floating_point()
    ):
        # next-token prediction: position t predicts token t + 1
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1)
        )
    target = _integer_target(batch, logits.shape[0])
    if target is not None and logits.dim() == 2:
        return F.cross_entropy(logits.float(), target.reshape(-1) % logits.shape[-1])
    return logits.float().mean()


def _integer_target(batch: Any, rows: int) -> torch.Tensor | None:
    values = batch.values() if isinstance(batch, dict) else batch
    if not isinstance(values, list | tuple) and not isinstance(batch, dict):
        return None
    for v in list(values)[1:] if isinstance(values, list | tuple) else values:
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.numel() == rows:
            return v
    return None


def find_loss_fn(module: Any) -> LossFn | None:
    """The user's ``autoshard_loss(output, batch)`` in the target's module, if defined."""
    fn = getattr(module, "autoshard_loss", None)
    return fn if callable(fn) else None
