"""Failures by cause (issue 36): one from outside the model is tried again by the next run, with
the settings then in force; only the model's own counts against a configuration.

Trials are a function here (tests/test_study.py's Runner), so that this runs in seconds."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from autoshard.config import Candidate, WorkloadSpec
from autoshard.results import TrialResult, TrialStatus
from autoshard.study.causes import CAUSES, Cause, cause_of, classified
from autoshard.study.dominance import dominated_by
from autoshard.study.lessons import learn

from ..test_study import Runner, space, study

DISK_FULL = (
    "workers exited: rank 0 exited with code 1: OSError: [Errno 28] No space left on device: "
    "'/out/workers/group-1-ab12cd/result-0.json'"
)
NOT_STARTED = (
    "the worker group exited while starting: rank 1 exited with code 1: OverflowError: Python "
    "int too large to convert to C int"
)


def failed(c: Candidate, error: str, status: str = "error", transient: bool = False):
    return TrialResult(candidate=c, status=status, error=error, world_size=2, transient=transient)


@pytest.mark.parametrize(
    ("error", "transient"), [(DISK_FULL, False), (NOT_STARTED, True)], ids=["disk", "launch"]
)
def test_an_environment_failure_is_tried_again_by_the_next_run(
    tmp_path, error: str, transient: bool
) -> None:
    """The first run: NO_SHARD fails from outside the model, is retried once at once and fails
    again; the others run. The next run (the space freed, a sane setting) tries it again,
    although the first one had settled it, and nothing else; a model's own error stays."""
    cands = space(sizes=(1,), precisions=("32-true",))
    env, model = cands[0], cands[1]  # NO_SHARD, SHARD_GRAD_OP

    def first_run(c: Candidate, n: int) -> TrialResult | None:
        if c == env:
            return failed(c, error, transient=transient)
        if c == model:
            return failed(c, "rank 0: RuntimeError: the model says no")
        return None

    before = Runner(first_run)
    name, _ = study(tmp_path, cands, before, n_trials=3)
    assert Counter(before.calls) == {env.label(): 2, model.label(): 1, cands[2].label(): 1}

    after = Runner()
    again, results = study(tmp_path, cands, after, n_trials=3)
    assert again == name
    assert after.calls == [env.label()]  # the model's error is not run again
    settled = {r.candidate.label(): r.status for r in results}
    assert settled[env.label()] is TrialStatus.OK
    assert settled[model.label()] is TrialStatus.ERROR


def test_the_table_says_what_counts_against_a_configuration() -> None:
    c = Candidate()
    cases = {
        Cause.MODEL: failed(c, "rank 1: RuntimeError: shapes do not match"),
        Cause.HANG: failed(c, "no result after 9.1 s (trial timeout 8 s)", status="timeout"),
        Cause.OOM: failed(c, "rank 0: OutOfMemoryError: CUDA out of memory", status="oom"),
        Cause.DIVERGED: failed(c, "loss nan at step 2 of 5 (rank 0)", status="diverged"),
        Cause.SIGNAL: failed(c, "rank 1 was killed by SIGKILL (signal 9)", transient=True),
        Cause.LAUNCH: failed(c, NOT_STARTED, transient=True),
        Cause.DISK: failed(c, DISK_FULL),
        Cause.LEFTOVER: failed(c, "rank 0: OutOfMemoryError: CUDA out of memory", status="oom")
        .model_copy(update={"contaminated": True}),
    }  # fmt: skip
    for cause, result in cases.items():
        assert cause_of(result) is cause, (cause, result.error)
    # an error only one of two ranks raised is that rank's (its data, its node): retried,
    # teaching nothing; one both raised is the model's; a record without the count (older) too
    alone = failed(c, "rank 1: ValueError: bad row 7").model_copy(update={"raised_on": 1})
    both = alone.model_copy(update={"raised_on": 2})
    assert cause_of(alone) is Cause.ONE_RANK and CAUSES[Cause.ONE_RANK].transient
    assert cause_of(both) is Cause.MODEL
    untried = [Candidate(micro_batch_size=2)]
    assert learn([c, *untried], [alone], [u.label() for u in untried]).ruled_out == {}
    # a record that says a signal killed a rank, without the flag (an older autoshard's)
    unflagged = failed(c, "torchrun was stopped by SIGTERM (signal 15)")
    assert cause_of(unflagged) is Cause.SIGNAL
    assert {k for k, v in CAUSES.items() if v.counts} == {Cause.MODEL, Cause.HANG, Cause.OOM}
    assert {k for k, v in CAUSES.items() if v.transient} == {
        Cause.SIGNAL,
        Cause.LAUNCH,
        Cause.DISK,
        Cause.LEFTOVER,
        Cause.ONE_RANK,
    }
    # a contaminated OOM dominates nothing and teaches no lesson
    assert dominated_by(Candidate(micro_batch_size=2), [cases[Cause.LEFTOVER]]) is None
    # what the journal records: a full disk is transient, whatever the worker group could tell
    assert classified(cases[Cause.DISK]).transient
    assert not classified(cases[Cause.MODEL]).transient
    assert cause_of(TrialResult(candidate=c, status="ok")) is None


def test_a_failure_from_outside_the_model_rules_nothing_out() -> None:
    """The same error on two configurations that share a setting rules out the untried ones
    with it, unless the error is a full disk; an OOM of a full disk dominates nothing."""
    cands = [Candidate(precision=p, micro_batch_size=m) for p in ("bf16-mixed", "32-true")
             for m in (1, 2, 4)]  # fmt: skip
    untried = [c.label() for c in cands[2:]]
    model = [failed(c, "rank 0: RuntimeError: bad shape") for c in cands[:2]]
    disk = [failed(c, DISK_FULL) for c in cands[:2]]
    assert cands[2].label() in learn(cands, model, untried).ruled_out
    assert learn(cands, disk, untried).ruled_out == {}
    oom = failed(cands[0], "rank 0: OSError: [Errno 28] No space left on device", status="oom")
    assert dominated_by(cands[1], [oom]) is None
    real_oom = failed(cands[0], "rank 0: OutOfMemoryError: out of memory", status="oom")
    assert dominated_by(cands[1], [real_oom]) is real_oom


# --------------------------------------------------------------------------------------------
# A worker log: a trial that printed between the cap and 1.5 times it (issue 36)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("end", ["new_section", "close"])
def test_a_trials_log_is_cut_to_its_cap_when_the_trial_ends(tmp_path, end: str) -> None:
    from autoshard.trials.logcap import CappedLog

    cap = 1000
    log = CappedLog(tmp_path / "group.log", cap)
    printed = b"".join(b"line %04d\n" % i for i in range(130))  # 1,300 bytes: 1.3 x the cap
    for at in range(0, len(printed), 100):
        log.write(printed[at : at + 100])
    getattr(log, end)()
    if end == "new_section":
        log.write(b"next trial\n")
        log.close()
    text = (tmp_path / "group.log").read_bytes()
    first = text.split(b"next trial")[0]
    assert b"bytes of worker output left out here" in first
    assert len(first) <= cap + 200, len(first)  # the cap and one marker line
    assert first.startswith(printed[: cap // 2]) and first.endswith(printed[-cap // 2 :])
    left = int(first.split(b"[autoshard: ")[1].split()[0])
    assert left == len(printed) - cap  # what the marker says is what was left out


# --------------------------------------------------------------------------------------------
# A deleted trials.jsonl is written again (issue 36)
# --------------------------------------------------------------------------------------------


def test_a_deleted_journal_is_written_again_from_the_study_database(tmp_path) -> None:
    from ..test_study import journal

    cands = space(sizes=(1, 2), precisions=("32-true",))
    name, first = study(tmp_path, cands, Runner(), n_trials=3)
    recorded = journal(tmp_path, name)
    assert len(recorded) == len(first) >= 3
    (tmp_path / "trials.jsonl").unlink()
    said: list[str] = []
    again = Runner()
    study(tmp_path, cands, again, n_trials=3, notices=said)
    assert again.calls == []  # resumed from the database: nothing runs
    restored = journal(tmp_path, name)
    assert [(r.candidate.label(), r.started_at) for r in restored] == [
        (r.candidate.label(), r.started_at) for r in recorded
    ]
    assert any("lacked" in line and "written back" in line for line in said), said
    said.clear()
    study(tmp_path, cands, Runner(), n_trials=3, notices=said)  # in line now: no word
    assert not any("written back" in line for line in said) and len(journal(tmp_path, name)) == len(
        recorded
    )


# --------------------------------------------------------------------------------------------
# A factory that hangs in the driver says what autoshard waits for (issue 36)
# --------------------------------------------------------------------------------------------


def test_a_factory_that_hangs_in_the_driver_is_said_in_one_line(monkeypatch) -> None:
    import warnings

    from autoshard.target import resolve
    from autoshard.target.resolve import FactoryWaitWarning, TargetSpec, build_target

    monkeypatch.setattr(resolve, "FACTORY_WAIT_S", 0.5)
    spec = TargetSpec(spec="tests/targets/faults.py:build", kwargs={"build_seconds": 2.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        build_target(spec)
        took = time.monotonic() - started
    said = [str(w.message) for w in caught if issubclass(w.category, FactoryWaitWarning)]
    assert len(said) == 1 and took >= 2.0, (said, took)
    assert said[0].startswith("build() has not returned after 0.5 s (now at faults.py:")
    assert "in build)" in said[0] and "--trial-timeout" in said[0]
    with warnings.catch_warnings(record=True) as caught:  # a quick factory: nothing said
        warnings.simplefilter("always")
        build_target(TargetSpec(spec="tests/targets/faults.py:build"))
        time.sleep(0.8)
    assert not [w for w in caught if issubclass(w.category, FactoryWaitWarning)]


# --------------------------------------------------------------------------------------------
# A NaN loss: the trial's result says diverged, at which step, with its steps kept
# --------------------------------------------------------------------------------------------


def test_a_non_finite_loss_on_any_rank_is_a_diverged_trial() -> None:
    from autoshard.results import TrialStatus
    from autoshard.target.resolve import TargetSpec
    from autoshard.trials.accounting import summarize
    from autoshard.trials.protocol import RankReport, TrialReply, TrialRequest

    request = TrialRequest(n=0, candidate=Candidate(), target=TargetSpec(spec="m.py:build"),
                           workload=WorkloadSpec(seq_len=8))  # fmt: skip

    def rank(r: int, losses: tuple[float, ...]) -> RankReport:
        return RankReport(rank=r, status="ok", step_times=(0.1, 0.2), allocated=1, samples=1,
                          tokens=8, losses=losses)  # fmt: skip

    fine = summarize(request, [rank(0, (2.0, 1.9, 1.8)), rank(1, (2.0, 1.9, 1.8))])
    assert fine.status is TrialStatus.OK and fine.error is None
    late = summarize(request, [rank(0, (2.0, 1.9, 1.8)), rank(1, (2.0, float("inf"), 1.8))])
    assert late.status is TrialStatus.DIVERGED
    assert late.error == "loss inf at step 2 of 3 (rank 1)"
    assert late.step_times == (0.1, 0.2) and late.step_time is not None  # its steps are kept
    both = summarize(request, [rank(0, (2.0, 1.9, float("nan"))), rank(1, (float("nan"),) * 3)])
    assert both.error == "loss nan at step 1 of 3 (rank 1)"  # the earliest step
    # written and read back as JSON: NaN is not lost as null
    again = TrialReply.model_validate_json(both.model_dump_json())
    assert again.losses[2] != again.losses[2]
