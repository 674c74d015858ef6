"""Why a trial failed, and what that says about its configuration: one table.

A failed trial is classified by its cause (:func:`cause_of`, read from the recorded result) and
the cause decides two things (:data:`CAUSES`):

- *transient*: the cause lies outside the model and the configuration (a full disk, a signal
  from outside, a worker group that could not start under a setting the OS refused, ...). The
  trial is retried once at once, and every later run tries it again with the settings then in
  force: such a failure never settles a candidate for good
  (:meth:`autoshard.study.view.StudyView.settled`).
- *counts against the configuration*: what the study learns from the failure about other
  candidates (:mod:`autoshard.study.lessons` rules out those that share the failing setting;
  :func:`autoshard.study.dominance.dominated_by` skips a larger micro-batch of one that ran out of
  memory). Only the model's own failures count (an error counts when every rank raised it:
  ``TrialResult.raised_on``); a transient one never does, and a diverged loss
  neither (the model's training step, not the configuration, is usually why).

A new kind of failure is one row of :data:`CAUSES` and one rule of :func:`cause_of`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from autoshard.results import TrialResult, TrialStatus


class Cause(str, Enum):
    """What made a launched trial fail (or diverge)."""

    MODEL = "model"  # an exception of the model's code
    HANG = "hang"  # no result within --trial-timeout
    OOM = "oom"  # out of memory (a CPU worker: over its memory cap)
    DIVERGED = "diverged"  # every step ran, the loss became NaN or infinite
    SIGNAL = "signal"  # a rank or torchrun killed by a signal (the OOM killer, a node's trouble)
    LAUNCH = "launch"  # the worker group did not start: no model code ran (a setting, a port)
    DISK = "disk"  # no space left, a quota, a read-only file system
    LEFTOVER = "leftover"  # it started with an earlier trial's memory (TrialResult.contaminated)
    ONE_RANK = "one rank"  # an error only some ranks raised: their data or node, not the model's


@dataclass(frozen=True)
class CauseTraits:
    transient: bool  # retried once at once, and again by every later run
    counts: bool  # counts against the configuration: lessons and dominance learn from it
    advice: str  # what to do when every trial failed this way


_LOGS = "the workers' logs are in the output folder, under workers/"

CAUSES: dict[Cause, CauseTraits] = {
    Cause.MODEL: CauseTraits(False, True, f"fix the model or its arguments ({_LOGS})"),
    Cause.HANG: CauseTraits(False, True, "raise --trial-timeout if a trial needs longer"),
    Cause.OOM: CauseTraits(False, True, "plan more GPUs or smaller micro-batches"),
    Cause.DIVERGED: CauseTraits(
        False,
        False,
        "the loss became NaN or infinite: the model's training step (its learning rate, loss "
        "scaling, an fp16 overflow), not the configuration, is usually why; fix the step",
    ),
    Cause.SIGNAL: CauseTraits(
        True, False, "a rank was killed from outside (the OOM killer?); run the same command again"
    ),
    Cause.LAUNCH: CauseTraits(
        True,
        False,
        f"the worker group did not start ({_LOGS}); fix what its log says, then run the same "
        "command again: these candidates are tried again",
    ),
    Cause.DISK: CauseTraits(
        True, False, "free space on the disk, then run the same command again: they are retried"
    ),
    Cause.ONE_RANK: CauseTraits(
        True,
        False,
        f"an error some ranks raised and others did not ({_LOGS}): the data a rank read or its "
        "node, not the configuration; run the same command again: these candidates are retried",
    ),
    Cause.LEFTOVER: CauseTraits(
        True,
        False,
        "the trial started with an earlier trial's memory still allocated (its worker group is "
        "restarted); run the same command again: these candidates are tried again",
    ),
}

# What the worker group writes (autoshard.trials.group): a signal's death, a launch that failed.
_SIGNALLED = re.compile(r"killed by SIG|stopped by SIG|killed by signal|stopped by signal")
_LAUNCH = re.compile(r"the worker group (exited while starting|did not start)")
# An OSError of the disk, as Python and SQLite say it, wherever it surfaced.
_DISK = re.compile(
    r"No space left on device|\[Errno 28\]|database or disk is full|Disk quota exceeded|"
    r"\[Errno 122\]|Read-only file system|\[Errno 30\]"
)


def cause_of(result: TrialResult) -> Cause | None:
    """The cause of a launched trial's failure; None for a trial that ran fine or never ran.

    >>> from autoshard import Candidate, TrialResult
    >>> full = TrialResult(candidate=Candidate(), status="error",
    ...                    error="workers exited: rank 0 exited with code 1: OSError: [Errno 28] "
    ...                          "No space left on device")
    >>> cause_of(full).value, CAUSES[cause_of(full)].transient
    ('disk', True)
    """
    status = result.status
    if status is TrialStatus.OK or not status.launched:
        return None
    if status is TrialStatus.DIVERGED:
        return Cause.DIVERGED
    if result.contaminated:  # a full GPU's error is the group's, not the configuration's
        return Cause.LEFTOVER
    text = result.error or ""
    if _DISK.search(text):
        return Cause.DISK
    if _LAUNCH.search(text):
        return Cause.LAUNCH
    if result.transient or _SIGNALLED.search(text):
        return Cause.SIGNAL
    if status is TrialStatus.OOM:
        return Cause.OOM
    if status is TrialStatus.TIMEOUT:
        return Cause.HANG
    if result.raised_on is not None and result.raised_on < result.world_size:
        return Cause.ONE_RANK
    return Cause.MODEL


def traits(result: TrialResult) -> CauseTraits | None:
    cause = cause_of(result)
    return None if cause is None else CAUSES[cause]


def is_transient(result: TrialResult) -> bool:
    """A failure from outside the model: retried (see the module docstring)."""
    found = traits(result)
    return found is not None and found.transient


def counts_against(result: TrialResult) -> bool:
    """A failure the study may learn from about other configurations."""
    found = traits(result)
    return found is not None and found.counts


def classified(result: TrialResult) -> TrialResult:
    """``result`` with ``transient`` as its cause says (a full disk is, whatever the worker
    group could tell): what the journal and the report show."""
    transient = is_transient(result)
    return (
        result
        if result.transient == transient
        else result.model_copy(update={"transient": transient})
    )
