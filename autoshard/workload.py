"""The workload of one training step: its micro-batch sizes and sequence length, from what the
user gave, the batch the target returns and the model's context, and a note for every number that
was assumed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from autoshard.analyze import find_context
from autoshard.config import WorkloadSpec
from autoshard.errors import ConfigError
from autoshard.options import PlanOptions
from autoshard.results import ModelProfile
from autoshard.target.resolve import BuiltModel
from autoshard.target.step import batch_samples, find_vocab_size

# Micro-batch sizes tried when neither a batch nor a batch size is given.
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)
# Sequence length assumed for a token model when none is given: its context, at most this.
DEFAULT_SEQ_LEN_CAP = 4096


def micro_batch_sizes(built: BuiltModel, options: PlanOptions) -> tuple[int, ...]:
    """The sizes asked for, the example batch's (the loader's), or 1, 2, 4, 8; a loader whose
    batch size is fixed gives only its own."""
    if built.data is not None and built.data.fixed:
        return (built.data.samples,)
    if options.batch_size is not None:
        return options.batch_size
    if built.batch is not None:
        return (batch_samples(built.batch),)
    return DEFAULT_MICRO_BATCH_SIZES


def resolve_workload(
    built: BuiltModel,
    options: PlanOptions,
    source: str = "the target",
    *,
    profile: ModelProfile | None = None,
) -> tuple[WorkloadSpec, list[str]]:
    """The workload of one step, and a note for every number that was assumed.

    A batch that ``source`` returns is used as built (its FLOPs and activations are counted on
    it), so a ``seq_len`` that contradicts its token length is an error: counted at one length
    and reported at the other, the tokens/s and the memory would belong to different steps.
    So is a sequence past the model's context (``profile.context_length``, or found on the
    model): estimated, it would look fine; trained, it fails in every trial (an index past a
    positional table)."""
    notes: list[str] = []
    vocab = find_vocab_size(built.model)
    seq_len = options.seq_len
    built_len = _batch_seq_len(built.batch) if built.batch is not None else None
    if seq_len is not None and built_len is not None and seq_len != built_len:
        raise ConfigError(
            f"seq_len {seq_len} but the batch {source} returns has {built_len} tokens per "
            f"sample, and that batch is what is measured: build it with {seq_len} (e.g. --arg "
            f"seq_len={seq_len}, or kwargs={{'seq_len': {seq_len}}} in code) or leave out "
            "--seq-len / seq_len="
        )
    if seq_len is None:
        seq_len = built_len
    limit = (
        (profile.context_length, profile.context_source)
        if profile is not None and profile.context_length
        else find_context(built.model)
    )
    context = limit[0] if limit else None
    if seq_len is not None and limit is not None and seq_len > limit[0]:
        past = f"past the model's context of {limit[0]} tokens ({limit[1]})"
        raise ConfigError(
            f"seq_len {seq_len} is {past}: give --seq-len {limit[0]} or less (seq_len= in code)"
            if options.seq_len is not None
            else f"the batch {source} returns has {seq_len} tokens per sample, {past}: build it "
            f"with {limit[0]} or fewer"
        )
    if seq_len is None and vocab is not None:
        seq_len = min(context or DEFAULT_SEQ_LEN_CAP, DEFAULT_SEQ_LEN_CAP)
        origin = f"the model's context ({context})" if context else "assumed"
        capped = " capped" if context and context > seq_len else ""
        notes.append(f"seq_len {seq_len}: {origin}{capped}; give --seq-len / seq_len= for yours")
    data = built.data
    if data is not None and data.fixed:
        asked = (
            f", not --batch-size {','.join(map(str, options.batch_size))}"
            if options.batch_size not in (None, (data.samples,))
            else ""
        )
        notes.append(
            f"micro-batch {data.samples}{asked}: {data.origin} makes its batches itself (its "
            "own batch_sampler, batch_size=None or made batches), so trials and estimates use "
            "its size; give a DataLoader with batch_size= to compare sizes"
        )
    workload = WorkloadSpec(
        micro_batch_size=micro_batch_sizes(built, options)[0],
        seq_len=seq_len,
        vocab_size=vocab,
        loop=options.loop,
        accumulate=options.accumulate,
    )
    return workload, notes


def _batch_seq_len(batch: Any) -> int | None:
    first = batch
    if isinstance(batch, Mapping):
        first = batch.get("input_ids", batch.get("decoder_input_ids"))
    elif isinstance(batch, list | tuple) and batch:
        first = batch[0]
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None
