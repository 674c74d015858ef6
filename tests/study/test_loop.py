"""The driver's loop (autoshard/study/loop.py): --trials, resuming, claims shared by several
drivers, what the workers cannot run, transient crashes retried. Trials are a function here
(tests/test_study.py's Runner), so that this runs in seconds."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

from autoshard.config import Candidate
from autoshard.results import TrialResult, TrialStatus
from autoshard.sharding import cpu_workers_cannot_run

from ..test_study import Runner, journal, space, study


def test_trials_end_the_study_exactly_at_n(tmp_path: Path) -> None:
    cands = space()
    runner = Runner()
    _, results = study(tmp_path, cands, runner, n_trials=3, unfit=4)
    assert len(runner.calls) == 3 == len(set(runner.calls))
    assert sum(r.status.launched for r in results) == 3
    assert sum(r.status is TrialStatus.PRUNED for r in results) == 4  # recorded, never run
    # A larger --trials on the same study runs only the difference.
    more = Runner()
    study(tmp_path, cands, more, n_trials=5, unfit=4)
    assert len(more.calls) == 2 and not set(more.calls) & set(runner.calls)
    assert len([r for r in journal(tmp_path) if r.status.launched]) == 5


def test_what_the_workers_cannot_run_is_skipped_with_its_reason_never_launched(
    tmp_path: Path,
) -> None:
    # CPU workers cannot run FSDP1's CPU offload: it leads the order here, yet is never run
    cands = [c.model_copy(update={"cpu_offload": True}) for c in space(sizes=(1,))] + space()
    runner = Runner()
    _, results = study(tmp_path, cands, runner, n_trials=3, cannot_run=cpu_workers_cannot_run)
    assert len(runner.calls) == 3 and not any("offload" in label for label in runner.calls)
    skipped = [r for r in results if r.status is TrialStatus.SKIPPED]
    assert len(skipped) == 6 and all(r.candidate.cpu_offload for r in skipped)
    assert all("needs a GPU" in (r.error or "") for r in skipped)
    # FSDP2's offload runs on CPU processes (tests/test_group.py trains it there)
    assert cpu_workers_cannot_run(Candidate(engine="fsdp2", cpu_offload=True)) is None


def test_a_killed_study_resumes_without_losing_or_rerunning(tmp_path: Path) -> None:
    cands = space()

    def killed_at_third(c: Candidate, n: int) -> TrialResult | None:
        if len(runner.calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C (or a kill) in the middle of the third trial
        return None

    runner = Runner(killed_at_third)
    with pytest.raises(KeyboardInterrupt):
        study(tmp_path, cands, runner, n_trials=5)
    done_before = [r.candidate.label() for r in journal(tmp_path)]
    assert len(done_before) == 2

    rerun = Runner()
    _, results = study(tmp_path, cands, rerun, n_trials=5)
    assert not set(rerun.calls) & set(done_before)  # finished trials are not rerun
    assert runner.calls[2] in rerun.calls  # the interrupted one is run again
    assert len(rerun.calls) == 3 and sum(r.status.launched for r in results) == 5


def test_two_drivers_share_one_study_without_running_a_candidate_twice(tmp_path: Path) -> None:
    # Two drivers (own output folders, one SQLite storage) in threads: the claim lock is what
    # keeps them apart (PostgreSQL with real processes: tests/test_study_slow.py).
    cands = space()
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    runner = Runner(delay=0.05)
    outcomes: dict[str, list[TrialResult]] = {}
    errors: list[BaseException] = []

    def driver(name: str) -> None:
        try:
            _, outcomes[name] = study(tmp_path / name, cands, runner, n_trials=9, storage=storage)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=driver, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(runner.calls) == 9 == len(set(runner.calls))  # the cap counts both drivers
    ran_by = {n: {r.candidate.label() for r in journal(tmp_path / n)} for n in ("a", "b")}
    assert ran_by["a"] and ran_by["b"] and not ran_by["a"] & ran_by["b"]
    # Both decide on every trial: the same results, in the same order.
    assert [r.started_at for r in outcomes["a"]] == [r.started_at for r in outcomes["b"]]


def test_a_transient_crash_is_retried_once(tmp_path: Path) -> None:
    cands = space(sizes=(1,), precisions=("32-true",))

    def crash(c: Candidate, n: int) -> TrialResult | None:
        if c == cands[0]:  # always crashes by a signal
            return TrialResult(
                candidate=c, status="error", error="killed by SIGKILL", transient=True
            )
        if c == cands[1] and n == 1:  # crashes once, then runs
            return TrialResult(
                candidate=c, status="error", error="killed by SIGBUS", transient=True
            )
        return None

    runner = Runner(crash)
    _, results = study(tmp_path, cands, runner, n_trials=3)
    assert Counter(runner.calls) == {cands[0].label(): 2, cands[1].label(): 2, cands[2].label(): 1}
    by_label = {r.candidate.label(): r for r in results}
    assert by_label[cands[1].label()].status is TrialStatus.OK
    assert by_label[cands[0].label()].transient  # crashed twice: settled as crashed


def test_a_transient_crash_is_retried_by_the_next_run(tmp_path: Path) -> None:
    cands = space(sizes=(1,), precisions=("32-true",))

    def crash_then_stop(c: Candidate, n: int) -> TrialResult | None:
        if len(runner.calls) == 1:
            return TrialResult(
                candidate=c, status="error", error="killed by SIGKILL", transient=True
            )
        raise KeyboardInterrupt  # stopped before the retry

    runner = Runner(crash_then_stop)
    with pytest.raises(KeyboardInterrupt):
        study(tmp_path, cands, runner, n_trials=2)
    rerun = Runner()
    study(tmp_path, cands, rerun, n_trials=2)
    assert rerun.calls[0] == runner.calls[0]  # the crashed one first, once more
    assert len(rerun.calls) == 2
