"""Dominance: when a measured trial makes trying a candidate pointless (the study skips it).

- the same configuration with less checkpointing / no offload already ran fine: more recompute
  or offload can only cost time, so it cannot be faster;
- the same configuration at a smaller micro-batch already ran out of memory: a larger one will
  too (an OOM counts when its trial ran clean: one that started with an earlier trial's memory,
  ``TrialResult.contaminated``, rules nothing out; one predicted to fit is tried once more in a
  fresh worker group before it is recorded).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.config import Candidate, Checkpointing
from autoshard.results import TrialResult, TrialStatus
from autoshard.study.causes import counts_against

# The fields the dominance rules reason about; every other field must be equal.
_CHECKPOINT_FIELDS = frozenset({"checkpointing", "checkpoint_every", "checkpoint_classes"})
_SAVING_FIELDS = _CHECKPOINT_FIELDS | {"cpu_offload"}


def _recompute_share(c: Candidate) -> float:
    """Share of the checkpoint classes' blocks recomputed in backward."""
    match c.checkpointing:
        case Checkpointing.NONE:
            return 0.0
        case Checkpointing.EVERY_K:
            return 1.0 / c.checkpoint_every
        case Checkpointing.ALL:
            return 1.0
        case Checkpointing.SELECTIVE:
            # every block, part of each: more than none, less than all (its memory too)
            return 0.5
    raise AssertionError(c.checkpointing)


def _same_except(a: Candidate, b: Candidate, fields: frozenset[str]) -> bool:
    return a.model_dump(exclude=set(fields)) == b.model_dump(exclude=set(fields))


def _saves_less_or_equal(a: Candidate, b: Candidate) -> bool | None:
    """Whether ``a`` recomputes and offloads no more than ``b`` (None: not comparable, e.g.
    checkpointing of different classes)."""
    both_checkpoint = a.checkpointing is not Checkpointing.NONE and (
        b.checkpointing is not Checkpointing.NONE
    )
    if both_checkpoint and a.checkpoint_classes != b.checkpoint_classes:
        return None
    # op-level against one block in k: neither recomputes (nor keeps) less than the other
    if {a.checkpointing, b.checkpointing} == {Checkpointing.SELECTIVE, Checkpointing.EVERY_K}:
        return None
    return _recompute_share(a) <= _recompute_share(b) and a.cpu_offload <= b.cpu_offload


def dominated_by(candidate: Candidate, done: Sequence[TrialResult]) -> TrialResult | None:
    """A finished trial that makes trying ``candidate`` pointless (see the module docstring).

    Each rule holds everything equal except what it reasons about: checkpointing and offload
    (and, for an OOM, the micro-batch size). A different wrap policy, engine, precision,
    sharding, reshard policy or optimizer implementation is never dominated.
    """
    for r in done:
        o = r.candidate
        if o == candidate or (r.status is not TrialStatus.OK and not counts_against(r)):
            continue  # a failure from outside the model says nothing about the configuration
        # The same configuration with less recompute / no offload ran fine: more recompute or
        # offload can only cost time.
        if (
            r.status is TrialStatus.OK
            and _same_except(o, candidate, _SAVING_FIELDS)
            and _saves_less_or_equal(o, candidate)
        ):
            return r
        if r.status is TrialStatus.OOM and _same_except(
            o, candidate, _SAVING_FIELDS | {"micro_batch_size"}
        ):
            # It ran out of memory while saving at least as much at no larger a micro-batch.
            no_larger = o.micro_batch_size <= candidate.micro_batch_size
            if _saves_less_or_equal(candidate, o) and no_larger:
                return r
    return None
