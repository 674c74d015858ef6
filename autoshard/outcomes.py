"""What became of a trial and of a candidate: :class:`TrialStatus` (what a trial ended as, in
``trials.jsonl``) and :data:`OUTCOMES`, one row per outcome in the words, colour and mark every
view gives it; a new kind of result is one row here."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class TrialStatus(str, Enum):
    OK = "ok"
    OOM = "oom"
    ERROR = "error"
    TIMEOUT = "timeout"
    # ran every step, but the loss became NaN or infinite: the model's training step (a learning
    # rate, an fp16 overflow) far more often than the configuration; never recommended
    DIVERGED = "diverged"
    PRUNED = "pruned"  # never launched: the estimate says it does not fit
    SKIPPED = "skipped"  # never launched: a failed trial rules it out (autoshard.study.lessons)

    @property
    def launched(self) -> bool:
        """Whether a trial with this status ran (pruned and skipped candidates never did)."""
        return self not in (TrialStatus.PRUNED, TrialStatus.SKIPPED)


class Outcome(NamedTuple):
    """What became of a candidate, in the words, colour and mark every view gives it (the
    terminal, ``print(rec)``, report.json's ``summary.outcomes``, report.html's charts and
    legends, the live view, optuna-dashboard's summary)."""

    word: str  # the one word every view says: "3 skipped"
    statuses: tuple[TrialStatus, ...]  # the trial statuses it covers
    says: str  # what a table writes before the reason: "skipped, never launched: ..."
    colour: str  # its colour in report.html
    mark: str  # how report.html draws it: "solid", "diamond", "cross", "outline", "hatched"


# One row per outcome: a new kind of result is one row here (a TrialStatus without a row of its
# own counts as failed).
OUTCOMES: tuple[Outcome, ...] = (
    Outcome("measured", (TrialStatus.OK,), "measured", "#4e79a7", "solid"),
    Outcome(
        "diverged",
        (TrialStatus.DIVERGED,),
        "diverged (ran, but the loss became NaN or infinite)",
        "#6a1b9a",
        "diamond",
    ),
    Outcome(
        "failed",
        (TrialStatus.OOM, TrialStatus.ERROR, TrialStatus.TIMEOUT),
        "failed",
        "#c62828",
        "cross",
    ),
    Outcome("skipped", (TrialStatus.SKIPPED,), "skipped, never launched", "#9e9e9e", "outline"),
    Outcome(
        "ruled out",
        (TrialStatus.PRUNED,),
        "predicted not to fit, never launched",
        "#757575",
        "hatched",
    ),
)


def outcome_of(status: TrialStatus) -> Outcome:
    """The row of :data:`OUTCOMES` a trial status falls under (failed where none names it).

    >>> outcome_of(TrialStatus.PRUNED).word, outcome_of(TrialStatus.OOM).word
    ('ruled out', 'failed')
    """
    failed = next(o for o in OUTCOMES if o.word == "failed")
    return next((o for o in OUTCOMES if status in o.statuses), failed)
