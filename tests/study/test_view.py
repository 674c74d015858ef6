"""The study as the storage has it (study/view.py): which attempt settles a candidate, the one
retry of a transient failure, a later run forgetting the transient failures before it, and the
count of launched candidates."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from autoshard.config import Candidate
from autoshard.results import TrialResult, TrialStatus
from autoshard.study.view import StudyView, identity

A = Candidate(micro_batch_size=1)
B = Candidate(micro_batch_size=2)
T0 = datetime(2026, 11, 28, 8, 0, tzinfo=timezone.utc)
KILLED = "rank 1 was killed by SIGKILL (signal 9)"  # from outside the model: transient


def result(c: Candidate, status: str = "ok", minutes: int = 0, **fields: object) -> TrialResult:
    if status == "error":
        fields = {"error": KILLED, "transient": True, "world_size": 2} | fields
    return TrialResult(
        candidate=c, status=status, started_at=T0 + timedelta(minutes=minutes), **fields
    )


def test_the_last_attempt_settles_unless_it_crashed_transiently_once() -> None:
    view = StudyView()
    view.add(result(A, "ok"))
    view.add(result(B, "error"))
    assert list(view.settled()) == [A.label()]
    assert view.to_retry() == [B.label()]  # retried once, on the spot
    view.running.add(B.label())
    assert view.to_retry() == []  # not while a driver runs it
    view.running.clear()
    view.add(result(B, "error", minutes=1))
    assert view.settled()[B.label()].status is TrialStatus.ERROR  # a second crash settles it
    assert view.to_retry() == []


def test_a_later_run_forgets_the_transient_failures_before_it() -> None:
    view = StudyView(since=T0 + timedelta(minutes=5))
    view.add(result(A, "error"))  # an earlier run's two crashes: tried again
    view.add(result(A, "error", minutes=1))
    view.add(result(B, "oom"))  # a failure of the model: kept
    assert list(view.settled()) == [B.label()]
    assert view.to_retry() == [A.label()]
    # in one run, the second crash would have settled it
    assert StudyView(attempts=dict(view.attempts)).settled().keys() == {A.label(), B.label()}


def test_a_retry_is_one_launched_candidate_and_identities_tell_attempts_apart() -> None:
    view = StudyView()
    view.add(result(A, "error"))
    view.add(result(A, "ok", minutes=1))
    view.add(result(B, "pruned"))  # never launched
    view.running.add("a third, running now")
    assert view.launched() == 2
    assert view.identities() == {identity(t) for t in view.attempts[A.label()]} | {
        identity(view.attempts[B.label()][0])
    }
    assert len(view.identities()) == 3
