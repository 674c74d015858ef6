"""The driver's loop: claim the next candidate, run it, record it; until ``--trials`` candidates
have been launched (by every driver of the study together) or none is left.

Each turn, under the storage's claim lock (:meth:`autoshard.study.storage.StudyStore.turn`):
1. the candidates predicted not to fit are recorded as pruned (once, by the first turn of any
   driver);
2. what the failures so far teach is applied (:mod:`autoshard.study.lessons`): the candidates
   they rule out are recorded as skipped with the reason, or the study stops when no candidate
   can avoid an error;
3. the next candidate is chosen: a transient crash's one retry first; then, while fewer than
   ``n_trials`` have been launched, the fastest-expected candidate that is neither settled,
   running, ruled out nor dominated (:func:`autoshard.study.dominance.dominated_by`) — or, while
   nothing has run fine, the one with the fewest of the settings the failures suspect;
4. it is claimed (a RUNNING trial), and run once the lock is released.
When nothing is left to claim while other drivers still run trials, the loop waits for them, so
that every driver decides on every trial.

No optuna here: the store is the only door to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from autoshard.config import Candidate, ProgressEvent
from autoshard.results import MemoryEstimate, Scored, TrialResult, TrialStatus
from autoshard.study.lessons import Lessons, learn, probe_order
from autoshard.study.view import ClaimLost, StudyView, Ticket, identity

Emit = Callable[[ProgressEvent, Scored], None]
Dominated = Callable[[Candidate, Sequence[TrialResult]], TrialResult | None]
Reorder = Callable[[Sequence[MemoryEstimate], Sequence[TrialResult]], list[MemoryEstimate]]
FactorsOf = Callable[[Candidate], dict[str, float] | None]
WAIT_S = 2.0  # how often a driver with nothing to claim looks again while others run trials


class Store(Protocol):
    """What the loop needs of :class:`autoshard.study.storage.StudyStore`."""

    def turn(self) -> AbstractContextManager[StudyView]: ...

    def view(self) -> StudyView: ...

    def record(self, result: TrialResult, estimate: str | None = None) -> None: ...

    def start(
        self, label: str, estimate: str | None = None, factors: dict[str, float] | None = None
    ) -> Ticket: ...

    def finish(self, ticket: Ticket, result: TrialResult) -> None: ...

    def abandon(self, ticket: Ticket) -> None: ...


@dataclass(frozen=True)
class TrialHooks:
    """What the study adds to the loop's order (each optional): ``dominated`` says which
    measured trial makes a candidate pointless; ``reorder``, the order to try the rest in after
    the trials so far; ``cannot_run``, why the workers cannot run a candidate (recorded as
    skipped with that reason, never launched); ``factors_of``, the calibrated factors a
    candidate's estimate (``reorder``'s) was predicted with, recorded with its trial beside that
    estimate (None: the uncalibrated model's)."""

    dominated: Dominated | None = None
    reorder: Reorder | None = None
    cannot_run: Callable[[Candidate], str | None] | None = None
    factors_of: FactorsOf | None = None


def run_trials(
    store: Store,
    ranked: Sequence[MemoryEstimate],
    run: Callable[[Candidate], TrialResult],
    *,
    n_trials: int,
    hooks: TrialHooks = TrialHooks(),
    emit: Emit | None = None,
    wait_s: float = WAIT_S,
) -> list[TrialResult]:
    """Run the study (see the module docstring); returns the result that settles each
    candidate, every driver's, in the order the storage recorded them."""
    loop = _Loop(store, ranked, n_trials, hooks, emit or (lambda kind, scored: None))
    first = True
    while True:
        try:
            choice, ticket, done = loop.turn(first)
        except ClaimLost:
            continue  # stopped while it held the claim, which another driver took: look again
        first = False
        if done:
            break
        if choice is None or ticket is None:
            time.sleep(wait_s)
            continue
        loop.tell(ProgressEvent.START, Scored(candidate=choice.candidate, estimate=choice))
        try:
            result = run(choice.candidate)
        except BaseException:
            store.abandon(ticket)
            raise
        store.finish(ticket, result)
        loop.seen.add(identity(result))
        loop.tell(ProgressEvent.DONE, _scored(result, loop.by_label))
    return list(store.view().settled().values())


class _Loop:
    """One driver's loop state: the candidates in the planned order, and the results it has
    announced (each once, whichever driver ran it)."""

    def __init__(
        self,
        store: Store,
        ranked: Sequence[MemoryEstimate],
        n_trials: int,
        hooks: TrialHooks,
        tell: Emit,
    ) -> None:
        self.store, self.ranked, self.n_trials, self.hooks = store, ranked, n_trials, hooks
        self.tell = tell
        self.by_label = {e.candidate.label(): e for e in ranked}
        self.candidates = [e.candidate for e in ranked]
        self.seen: set[tuple[str, str]] = set()

    def announce(self, view: StudyView, kind: ProgressEvent) -> None:
        for result in view.settled().values():
            if identity(result) not in self.seen:
                self.seen.add(identity(result))
                self.tell(kind, _scored(result, self.by_label))

    def turn(self, first: bool) -> tuple[MemoryEstimate | None, Ticket | None, bool]:
        """One turn under the claim lock: (the candidate claimed, its ticket, whether the study
        is over)."""
        store, ranked, by_label, hooks = self.store, self.ranked, self.by_label, self.hooks
        with store.turn() as view:
            if first:
                _record_pruned(store, ranked, view)
                _record_unrunnable(store, ranked, view, hooks.cannot_run)
                self.announce(view, ProgressEvent.RESUMED)
            else:
                self.announce(view, ProgressEvent.DONE)  # other drivers' trials
            settled = view.settled()
            untried = {
                label
                for label, e in by_label.items()
                if e.fits and label not in view.attempts and label not in view.running
            }
            lessons = learn(self.candidates, list(settled.values()), untried)
            for label, why in lessons.ruled_out.items():
                skipped = TrialResult(
                    candidate=by_label[label].candidate, status=TrialStatus.SKIPPED, error=why
                )
                store.record(skipped, by_label[label].model_dump_json())
                view.add(skipped)
            self.announce(view, ProgressEvent.DONE)
            # The order to try the rest in, after what was measured (a calibrated speed model).
            order = hooks.reorder(ranked, list(settled.values())) if hooks.reorder else ranked
            choice = _pick(view, order, self.candidates, lessons, self.n_trials, hooks.dominated)
            if choice is not None:
                factors = hooks.factors_of(choice.candidate) if hooks.factors_of else None
                label, estimate = choice.candidate.label(), choice.model_dump_json()
                return choice, store.start(label, estimate, factors), False
            return None, None, not view.running


def _pick(
    view: StudyView,
    ranked: Sequence[MemoryEstimate],
    candidates: Sequence[Candidate],
    lessons: Lessons,
    n_trials: int,
    dominated: Dominated | None,
) -> MemoryEstimate | None:
    retries = set(view.to_retry())
    for e in ranked:
        if e.candidate.label() in retries:
            return e  # already counted against n_trials
    if view.launched() >= n_trials:
        return None
    done = list(view.settled().values())
    eligible = [
        e
        for e in ranked
        if e.fits
        and e.candidate.label() not in view.attempts
        and e.candidate.label() not in view.running
        and e.candidate.label() not in lessons.ruled_out
        and not (dominated and dominated(e.candidate, done))
    ]
    if not eligible:
        return None
    if lessons.suspects is not None:
        order = probe_order(candidates, [e.candidate for e in eligible], lessons.suspects)
        by_candidate = {e.candidate.label(): e for e in eligible}
        return by_candidate[order[0].label()]
    return eligible[0]


def _record_pruned(store: Store, ranked: Sequence[MemoryEstimate], view: StudyView) -> None:
    for e in ranked:
        label = e.candidate.label()
        if not e.fits and label not in view.attempts:
            result = TrialResult(candidate=e.candidate, status=TrialStatus.PRUNED, error=e.reason)
            store.record(result, e.model_dump_json())
            view.add(result)


def _record_unrunnable(
    store: Store,
    ranked: Sequence[MemoryEstimate],
    view: StudyView,
    cannot_run: Callable[[Candidate], str | None] | None,
) -> None:
    if cannot_run is None:
        return
    for e in ranked:
        why = cannot_run(e.candidate)
        if why and e.fits and e.candidate.label() not in view.attempts:
            result = TrialResult(candidate=e.candidate, status=TrialStatus.SKIPPED, error=why)
            store.record(result, e.model_dump_json())
            view.add(result)


def _scored(result: TrialResult, by_label: dict[str, MemoryEstimate]) -> Scored:
    return Scored(
        candidate=result.candidate, estimate=by_label.get(result.candidate.label()), trial=result
    )
