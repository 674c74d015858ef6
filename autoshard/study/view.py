"""What a study's storage knows about each candidate, at one moment: its recorded attempts, and
whether a driver is running it now. Plain data, built by :mod:`autoshard.study.storage`, read by
the driver's loop and by :mod:`autoshard.study.lessons`.

A candidate is *settled* by its last attempt, unless that attempt was a transient failure (one
from outside the model: a rank killed by a signal, a full disk, a worker group that did not
start; :mod:`autoshard.study.causes`) that has not been retried yet: such a candidate is retried
once, on the spot; a second such failure settles it for this run. A later run forgets the
transient failures of the runs before it (``since``) and tries those candidates again, with the
settings then in force.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from autoshard.results import TrialResult
from autoshard.study.causes import is_transient

TRANSIENT_RETRIES = 1


class ClaimLost(Exception):
    """This driver's claim lock was taken from it while it was stopped (another driver took it
    for dead): it claims nothing on that turn, and takes its turn again."""


@dataclass
class StudyView:
    """The study as the storage has it (every driver's trials)."""

    attempts: dict[str, list[TrialResult]] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    # When this run began: transient failures recorded before it are tried again (None: all
    # count, as in one run)
    since: datetime | None = None

    def add(self, result: TrialResult) -> None:
        self.attempts.setdefault(result.candidate.label(), []).append(result)

    def settled(self) -> dict[str, TrialResult]:
        """The result that settles each candidate, in the order they were first recorded."""
        out: dict[str, TrialResult] = {}
        for label, tries in self.attempts.items():
            tries = [t for t in tries if not self._forgotten(t)]
            if not tries:
                continue  # only earlier runs' transient failures: tried again
            last = tries[-1]
            crashes = sum(1 for t in tries if is_transient(t))
            if not is_transient(last) or crashes > TRANSIENT_RETRIES:
                out[label] = last
        return out

    def _forgotten(self, result: TrialResult) -> bool:
        return self.since is not None and is_transient(result) and result.started_at < self.since

    def to_retry(self) -> list[str]:
        """Candidates whose last attempt crashed transiently and may run once more."""
        settled = self.settled()
        return [
            label for label in self.attempts if label not in settled and label not in self.running
        ]

    def launched(self) -> int:
        """Candidates launched so far (running now or with a launched attempt); a retry does
        not count twice."""
        ran = {
            label for label, tries in self.attempts.items() if any(t.status.launched for t in tries)
        }
        return len(ran | self.running)

    def identities(self) -> set[tuple[str, str]]:
        """(label, start time) of every recorded attempt: how journal records are matched."""
        return {identity(t) for tries in self.attempts.values() for t in tries}


@dataclass
class Ticket:
    """A claimed candidate: the RUNNING trial created for it in the storage."""

    trial_id: int
    label: str
    estimate: str | None = None  # the estimate's JSON: the prediction it is tried with
    factors: dict[str, float] | None = None  # the calibrated factors of that prediction


def identity(result: TrialResult) -> tuple[str, str]:
    return result.candidate.label(), result.started_at.isoformat()
