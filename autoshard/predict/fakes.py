"""What a model's forward needs to run on fake tensors the way it runs on real ones, and quietly.

Both predictors run models on ``FakeTensor``s (:mod:`autoshard.predict.activations` one forward,
:mod:`autoshard.predict.simulate` whole training steps). Two things get in the way there and not
in a real run:

- ``aten._grouped_mm`` (Hugging Face's default mixture-of-experts kernel, ``grouped_mm``) has a
  fake/meta implementation written for CUDA's kernel, which takes bf16 only, while the CPU kernel
  takes every float dtype: an fp32 Mixtral trains on the CPU but its fake forward fails ("Expected
  inputs of BF16 type", torch 2.13, ``torch/_meta_registrations.py``). Under
  :func:`fake_forward_support` the fake kernel answers every float dtype as the CPU kernel does:
  the output shape of the bf16 meta kernel, in the inputs' dtype.
- ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` ask whether the mask they are given is
  the causal one (``torch.nn.modules.transformer._detect_is_causal_mask``: ``bool((mask ==
  causal).all())``), a question about values that fake tensors cannot answer
  (``DataDependentOutputException``): the seed guide's demo Transformer (Lightning's
  ``lightning.pytorch.demos.Transformer``) fell back to the rule of thumb. Under
  :func:`fake_forward_support` a fake mask of the sequence's square shape is taken as causal,
  which is what the check finds for the ``generate_square_subsequent_mask`` masks these classes
  are given; either answer runs the same attention FLOPs and saves the same tensors but the
  mask.
- When a fake kernel fails, torch logs the whole traceback at error level
  (``torch._subclasses.fake_tensor``: "failed while attempting to run meta for ...") before the
  exception reaches autoshard, which falls back and says so in one line. Those records are dropped
  while autoshard's fake forwards run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

# torch loggers that report a failing fake kernel with a traceback (torch 2.13)
_NOISY_LOGGERS = ("torch._subclasses.fake_tensor",)


@contextlib.contextmanager
def fake_forward_support() -> Iterator[None]:
    """Run fake-tensor forwards with :func:`grouped_mm_in_every_float_dtype`,
    :func:`causal_masks_by_shape` and without torch's tracebacks of failing fake kernels
    (:func:`quiet_fake_kernel_errors`)."""
    with quiet_fake_kernel_errors(), grouped_mm_in_every_float_dtype(), causal_masks_by_shape():
        yield


@contextlib.contextmanager
def causal_masks_by_shape() -> Iterator[None]:
    """``nn.Transformer*``'s causal-mask check answered from a fake mask's shape (see the
    module's docstring); real masks are still checked by value."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.nn.modules import transformer

    detect = getattr(transformer, "_detect_is_causal_mask", None)
    if detect is None:
        yield
        return

    def by_shape(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
        if is_causal is None and isinstance(mask, FakeTensor):
            side = size if size is not None else mask.size(-2)
            return tuple(mask.shape) == (side, side)
        return bool(detect(mask, is_causal, size))

    transformer._detect_is_causal_mask = by_shape
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


@contextlib.contextmanager
def quiet_fake_kernel_errors() -> Iterator[None]:
    """Drop what torch's fake-tensor loggers log (a 20-line traceback per failing kernel); the
    exception itself still propagates."""

    def drop(_record: logging.LogRecord) -> bool:
        return False

    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def _grouped_mm_fake(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    mat_a, mat_b = args[0], args[1]
    if (
        mat_a.dtype == mat_b.dtype == torch.bfloat16
        or mat_a.dtype != mat_b.dtype
        or not mat_a.is_floating_point()
        or kwargs.get("out_dtype") is not None
    ):
        return NotImplemented  # torch's own fake kernel decides (and explains what it refuses)

    def meta(t: Any, dtype: torch.dtype | None = None) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device="meta")

    # Inside the fake mode's dispatch the modes are off: these are plain meta tensors.
    metas = [meta(mat_a, torch.bfloat16), meta(mat_b, torch.bfloat16)]
    rest = [meta(a) for a in args[2:]]
    shaped = func(*metas, *rest, **{k: meta(v) for k, v in kwargs.items()})
    out = torch.empty_strided(shaped.shape, shaped.stride(), dtype=mat_a.dtype, device="meta")
    return FakeTensor(fake_mode, out, mat_a.device)


@contextlib.contextmanager
def grouped_mm_in_every_float_dtype() -> Iterator[None]:
    """Let fake tensors run ``aten._grouped_mm`` in fp32 and fp16 as the CPU kernel does (see the
    module's docstring), for the duration of the block."""
    op = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)
    from torch._subclasses import fake_impls

    if op is None or op in fake_impls.op_implementations_dict:
        yield  # no such op in this torch, or a fake kernel of its own is registered
        return
    fake_impls.op_implementations_dict[op] = _grouped_mm_fake
    try:
        yield
    finally:
        fake_impls.op_implementations_dict.pop(op, None)


def experts_for_fake_tensors(model: Any) -> str:
    """Switch a Hugging Face mixture-of-experts model (this copy of it) from its ``eager``
    experts loop to ``grouped_mm``; a note saying so, or "" when nothing was switched.

    The eager loop runs each expert on the tokens routed to it (``torch.where`` on the routing:
    shapes that depend on data, which fake tensors cannot have). ``grouped_mm`` runs the same
    token-expert pairs as one matrix of tokens x top_k rows whatever the routing: balanced
    routing on average per expert, and the same rows in total as the loop (measured on the
    tiny example: the loop saves 6% more, its per-expert index copies)."""
    config = getattr(model, "config", None)
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if config is None or not callable(can_set) or not can_set():
        return ""
    if getattr(config, "_experts_implementation", None) != "eager":
        return ""
    try:
        model.set_experts_implementation("grouped_mm")
    except (ValueError, ImportError, RuntimeError):
        return ""
    return (
        "the experts' eager loop has data-dependent shapes; profiled with grouped_mm, for "
        "balanced routing (tokens x top_k expert rows)"
    )
