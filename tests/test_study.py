"""The study's storage side, quick tier: the study's name, the journal as the record of truth,
the output folder's lock, storage errors as one line, the driver's loop (the --trials cap,
resuming, claims shared by several drivers), and what failures teach.

Trials here are a function (the loop's `run`), so that these tests run in seconds; the same
loop with real worker groups is exercised by tests/test_search.py and tests/test_study_slow.py.
"""

from __future__ import annotations

import doctest
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from autoshard.config import Candidate, Engine, Hardware, WorkloadSpec
from autoshard.errors import StorageError, StudyLockedError, TrialsFailedError
from autoshard.results import MemoryBreakdown, MemoryEstimate, TrialResult, TrialStatus
from autoshard.sharding import cpu_workers_cannot_run
from autoshard.study import journal as journal_mod
from autoshard.study.dominance import dominated_by
from autoshard.study.journal import read_records
from autoshard.study.lessons import learn
from autoshard.study.lock import OutLock
from autoshard.study.loop import TrialHooks, run_trials
from autoshard.study.settings import StudySettings
from autoshard.study.storage import open_store
from autoshard.target.resolve import TargetSpec

GIB = 1024**3
TARGET = TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"})
HARDWARE = Hardware(gpus_per_node=2, gpu_memory=4 * GIB, backend="gloo")


def space(sizes=(1, 2, 4), precisions=("32-true", "bf16-mixed")) -> list[Candidate]:
    return [
        Candidate(sharding=s, precision=p, micro_batch_size=m)
        for p in precisions
        for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
        for m in sizes
    ]


def estimates(cands: list[Candidate], unfit: int = 0) -> list[MemoryEstimate]:
    """Ranked estimates: the first len - unfit fit, in the order given."""
    out = []
    for i, c in enumerate(cands):
        fits = i < len(cands) - unfit
        out.append(
            MemoryEstimate(
                candidate=c,
                method="analytic",
                gpu_peak=GIB,
                breakdown=MemoryBreakdown(),
                fits=fits,
                headroom=GIB if fits else -GIB,
                reason="" if fits else "needs 9 GiB per GPU",
            )
        )
    return out


def settings(sizes=(1, 2, 4), precisions=("32-true", "bf16-mixed")) -> StudySettings:
    return StudySettings.of(
        TARGET,
        HARDWARE,
        WorkloadSpec(seq_len=8),
        precisions=precisions,
        micro_batch_sizes=sizes,
    )


class Runner:
    """The loop's `run`: records every call; a rule decides each result."""

    def __init__(self, rule=None, delay: float = 0.0) -> None:
        self.calls: list[str] = []
        self.rule = rule or (lambda c, n: None)
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, c: Candidate) -> TrialResult:
        with self.lock:
            self.calls.append(c.label())
            n = Counter(self.calls)[c.label()]
        if self.delay:
            time.sleep(self.delay)
        custom = self.rule(c, n)
        if custom is not None:
            return custom
        return TrialResult(
            candidate=c,
            status="ok",
            world_size=2,
            step_time=0.1,
            tokens_per_s=1000.0 * c.micro_batch_size + (c.precision.value == "32-true"),
        )


def study(out: Path, cands, runner, *, n_trials=4, sett=None, storage=None, notices=None, **kw):
    """Open the store, run the loop, close: one `autoshard tune` in miniature."""
    said = notices if notices is not None else []
    with open_store(out, storage, notice=said.append) as store:
        store.open_study(sett or settings(), [c.label() for c in cands])
        unfit = kw.pop("unfit", 0)
        hooks = TrialHooks(**{k: kw.pop(k) for k in ("dominated", "cannot_run") if k in kw})
        results = run_trials(
            store, estimates(cands, unfit), runner, n_trials=n_trials, hooks=hooks, **kw
        )
        return store.name, results


def journal(out: Path, name: str | None = None) -> list[TrialResult]:
    return read_records(out / "trials.jsonl", name)


# ---------------------------------------------------------------------------------------------
# The study's name
# ---------------------------------------------------------------------------------------------


def test_the_name_follows_every_setting_and_ignores_order() -> None:
    base = settings()
    assert base.name() == settings(sizes=(4, 2, 1), precisions=("bf16-mixed", "32-true")).name()
    assert base.name() == settings(sizes=(1, 1, 2, 4)).name()  # duplicates
    changed = [
        settings(sizes=(1,)),
        settings(precisions=("32-true",)),
        base.model_copy(update={"hardware": HARDWARE.model_copy(update={"gpus_per_node": 4})}),
        base.model_copy(update={"workload": WorkloadSpec(seq_len=16)}),
        base.model_copy(update={"workload": WorkloadSpec(seq_len=8, loop="plain")}),
        base.model_copy(update={"workload": WorkloadSpec(seq_len=8, accumulate=4)}),
        base.model_copy(update={"engine": Engine.FSDP2}),
        base.model_copy(update={"target": TARGET.model_copy(update={"kwargs": {"size": "s"}})}),
        base.model_copy(update={"memory_cap": GIB}),
    ]
    names = {s.name() for s in changed} | {base.name()}
    assert len(names) == len(changed) + 1
    assert base.name(["a", "b"]) != base.name(["a"])  # another candidate set


def test_changed_settings_start_a_new_study_and_the_same_resume(tmp_path: Path) -> None:
    cands = space(sizes=(1, 2))
    first = Runner()
    name_a, _ = study(tmp_path, cands, first, n_trials=3, sett=settings(sizes=(1, 2)))
    assert len(first.calls) == 3

    # --batch-size 1 after 1,2: a new study; nothing measured at micro-batch 2 is reused.
    only_1 = [c for c in cands if c.micro_batch_size == 1]
    second = Runner()
    name_b, results_b = study(tmp_path, only_1, second, n_trials=2, sett=settings(sizes=(1,)))
    assert name_b != name_a
    assert len(second.calls) == 2
    assert {r.candidate.micro_batch_size for r in results_b} == {1}
    assert len(journal(tmp_path, name_b)) == 2 and len(journal(tmp_path, name_a)) == 3

    # The same settings again: resumed, nothing run twice.
    again = Runner()
    name_c, results_c = study(tmp_path, only_1, again, n_trials=2, sett=settings(sizes=(1,)))
    assert name_c == name_b and again.calls == []
    assert [r.started_at for r in results_c] == [r.started_at for r in results_b]


def test_a_changed_model_starts_a_new_study_and_says_so(tmp_path: Path) -> None:
    """The same factory and arguments, the model edited in between (issue 25, case 1): its
    structure is part of the name; the old trials are not resumed, and one line says why."""
    from torch import nn

    from autoshard.study.settings import model_fingerprint

    def of(width: int, target: TargetSpec = TARGET) -> StudySettings:
        model = nn.Sequential(nn.Embedding(64, width), nn.Linear(width, 64))
        sizes, precisions = (1, 2), ("32-true", "bf16-mixed")
        return StudySettings.of(target, HARDWARE, WorkloadSpec(seq_len=8), precisions=precisions,
                                micro_batch_sizes=sizes).with_model(model)  # fmt: skip

    assert of(16).model == model_fingerprint(nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64)))
    cands = space(sizes=(1, 2))
    first = Runner()
    name_a, _ = study(tmp_path, cands, first, n_trials=2, sett=of(16))
    wider, said = Runner(), []
    name_b, results = study(tmp_path, cands, wider, n_trials=2, sett=of(32), notices=said)
    assert name_b != name_a and len(wider.calls) == 2  # measured again, nothing resumed
    assert [r.started_at for r in results] == [r.started_at for r in journal(tmp_path, name_b)]
    changed = [line for line in said if "new study" in line]
    assert len(changed) == 1 and name_a in changed[0], said
    assert "the model (2,112 -> 4,160 parameters) changed" in changed[0]
    # Another target in the same folder says so.
    other = TargetSpec(spec="other/model.py:build")
    said.clear()
    study(tmp_path, cands, Runner(), n_trials=1, sett=of(32, other), notices=said)
    assert any("of another target (examples/gpt.py" in line for line in said), said
    # The same model again: resumed, without a line.
    said.clear()
    again = Runner()
    study(tmp_path, cands, again, n_trials=1, sett=of(32, other), notices=said)
    assert again.calls == [] and not said


def test_load_result_reads_only_its_own_study(tmp_path: Path) -> None:
    from autoshard.recommendation import Recommendation, load_result
    from autoshard.results import ModelProfile, Scored
    from autoshard.study.journal import record_line

    mine = TrialResult(candidate=Candidate(micro_batch_size=1), status="ok")
    other = TrialResult(candidate=Candidate(micro_batch_size=2), status="ok")
    (tmp_path / "trials.jsonl").write_bytes(
        record_line("autoshard-b", other) + record_line("autoshard-a", mine)
    )
    rec = Recommendation(
        profile=ModelProfile(
            target="t", model_class="m", total_params=1, trainable_params=1, param_bytes=4
        ),
        hardware=HARDWARE,
        workload=WorkloadSpec(),
        chosen=Scored(candidate=mine.candidate, trial=mine),
        basis="trials",
        study="autoshard-a",
    )
    (tmp_path / "recommendation.json").write_text(rec.model_dump_json())
    assert load_result(tmp_path)[1] == [mine]
    # A recommendation written before studies were named reads every record.
    (tmp_path / "recommendation.json").write_text(
        rec.model_copy(update={"study": None}).model_dump_json()
    )
    assert len(load_result(tmp_path)[1]) == 2


# ---------------------------------------------------------------------------------------------
# The loop: --trials, resuming, claims
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# What failures teach
# ---------------------------------------------------------------------------------------------


def test_an_error_rules_out_the_larger_micro_batches_of_that_configuration() -> None:
    cands = space()
    failed = next(c for c in cands if c.micro_batch_size == 2)
    result = TrialResult(candidate=failed, status="error", error="RuntimeError: shape [2, 8]")
    untried = {c.label() for c in cands} - {failed.label()}
    lessons = learn(cands, [result], untried)
    assert set(lessons.ruled_out) == {failed.model_copy(update={"micro_batch_size": 4}).label()}
    assert list(lessons.ruled_out.values()) == [
        f"{failed.label()} failed (error: RuntimeError: shape [2, 8]): the same configuration "
        "with a larger micro-batch would too"
    ]
    # Nothing ran fine yet: the next trial should have as few of its settings as it can.
    from autoshard.study.lessons import properties

    same, least = lessons.suspects
    assert least == 2 and same == {
        n: v for n, v in properties(failed).items() if n in ("sharding", "precision")
    }


def test_the_same_error_twice_rules_out_the_shared_setting() -> None:
    cands = space()
    bf16 = [c for c in cands if c.precision.value == "bf16-mixed"]
    fails = [
        TrialResult(candidate=bf16[0], status="error", error="RuntimeError: bf16 at step 1"),
        TrialResult(candidate=bf16[4], status="error", error="RuntimeError: bf16 at step 3"),
    ]
    fine = TrialResult(candidate=cands[0], status="ok")  # an fp32 one ran
    untried = {c.label() for c in cands} - {r.candidate.label() for r in [*fails, fine]}
    lessons = learn(cands, [*fails, fine], untried)
    assert set(lessons.ruled_out) == {c.label() for c in bf16} - {
        r.candidate.label() for r in fails
    }
    assert any("precision=bf16-mixed" in why for why in lessons.ruled_out.values())
    # A configuration with that setting ran fine: the setting is not the cause.
    bf16_fine = TrialResult(candidate=bf16[8], status="ok")
    lessons = learn(cands, [*fails, bf16_fine], untried - {bf16[8].label()})
    assert all("precision" not in why for why in lessons.ruled_out.values())


def test_the_same_error_on_configurations_that_share_nothing_stops_the_study() -> None:
    cands = space()
    a = Candidate(sharding="NO_SHARD", precision="32-true", micro_batch_size=1)
    b = Candidate(sharding="FULL_SHARD", precision="bf16-mixed", micro_batch_size=1)
    fails = [
        TrialResult(candidate=a, status="error", error="ValueError: bad batch key 'x' (1)"),
        TrialResult(candidate=b, status="error", error="ValueError: bad batch key 'x' (2)"),
    ]
    with pytest.raises(TrialsFailedError, match=r"share no setting.*bad batch key"):
        learn(cands, fails, {c.label() for c in cands} - {a.label(), b.label()})
    # ... unless something ran fine: then the error depends on the configuration.
    ok = TrialResult(candidate=cands[1], status="ok")
    learn(cands, [*fails, ok], set())


def test_the_same_cause_reported_by_other_ranks_and_launches_is_one_failure() -> None:
    """Issue 25, case 6: the same exit, seen on rank 1 then on rank 0, with another control
    folder each launch, is the same error: the study stops after these two trials."""
    cands = space()
    a = Candidate(sharding="NO_SHARD", precision="32-true", micro_batch_size=1)
    b = Candidate(sharding="FULL_SHARD", precision="bf16-mixed", micro_batch_size=1)
    said = "error: unrecognized arguments: --control /o/workers/group-{}"
    fails = [
        TrialResult(candidate=a, status="error", error=f"rank 1: SystemExit: exit code 2, called "
                    f"at model.py:9 in build ({said.format('1-3fa9c2')})"),
        TrialResult(candidate=b, status="error", error=f"rank 0: SystemExit: exit code 2, called "
                    f"at model.py:9 in build ({said.format('2-e07b1d')})"),
    ]  # fmt: skip
    with pytest.raises(TrialsFailedError, match=r"unrecognized arguments.*fix the model"):
        learn(cands, fails, {c.label() for c in cands} - {a.label(), b.label()})


def test_timeouts_everywhere_advise_a_longer_trial_timeout() -> None:
    from autoshard.decide import nothing_ran

    cands = space()
    why = "no result after 1.0 s (trial timeout 1 s); the worker group was killed"
    a = Candidate(sharding="NO_SHARD", precision="32-true", micro_batch_size=1)
    b = Candidate(sharding="FULL_SHARD", precision="bf16-mixed", micro_batch_size=1)
    fails = [TrialResult(candidate=c, status="timeout", error=why) for c in (a, b)]
    with pytest.raises(TrialsFailedError, match=r"raise --trial-timeout \(1 s\) if a trial needs"):
        learn(cands, fails, {c.label() for c in cands} - {a.label(), b.label()})
    assert "raise --trial-timeout (1 s)" in nothing_ran(fails)
    errors = [
        TrialResult(candidate=f.candidate, status="error", error="ValueError: x") for f in fails
    ]
    assert "--trial-timeout" not in nothing_ran(errors) and "fix the model" in nothing_ran(errors)


def test_a_model_that_always_fails_stops_after_two_trials(tmp_path: Path) -> None:
    def always(c: Candidate, n: int) -> TrialResult:
        return TrialResult(candidate=c, status="error", error=f"KeyError: 'labels' (rank {n})")

    runner = Runner(always)
    with pytest.raises(TrialsFailedError, match="KeyError"):
        study(tmp_path, space(), runner, n_trials=12)
    assert len(runner.calls) == 2  # the second is a probe unlike the first
    # The stop is recorded: the next run stops at once, running nothing.
    again = Runner(always)
    with pytest.raises(TrialsFailedError):
        study(tmp_path, space(), again, n_trials=12)
    assert again.calls == []


def test_a_hang_at_one_micro_batch_costs_few_trials(tmp_path: Path) -> None:
    def hangs_from_4(c: Candidate, n: int) -> TrialResult | None:
        if c.micro_batch_size >= 4:
            return TrialResult(candidate=c, status="timeout", error="no result within 20 s")
        return None

    # Largest micro-batch first (as the estimator ranks them: faster per sample).
    cands = sorted(space(), key=lambda c: -c.micro_batch_size)
    runner = Runner(hangs_from_4)
    _, results = study(tmp_path, cands, runner, n_trials=12, dominated=dominated_by)
    hangs = [label for label in runner.calls if "mbs4" in label]
    # Two hangs at fp32 teach "32-true, micro-batch >= 4"; a third at bf16 "micro-batch >= 4":
    # 3 of the 6 candidates at micro-batch 4 run (it was 5 of 6 trials before).
    assert len(hangs) == 3, runner.calls
    skipped = [r for r in results if r.status is TrialStatus.SKIPPED]
    assert {r.candidate.micro_batch_size for r in skipped} == {4} and len(skipped) == 3
    assert any("micro-batch >= 4" in (r.error or "") for r in skipped)
    assert len(runner.calls) == 12  # the cap is spent on the micro-batches that run
    # Skips are recorded with their reason, in the journal too.
    assert {r.candidate.label() for r in journal(tmp_path) if r.status is TrialStatus.SKIPPED} == {
        r.candidate.label() for r in skipped
    }


# ---------------------------------------------------------------------------------------------
# The journal: the record of truth
# ---------------------------------------------------------------------------------------------


def test_the_journal_is_written_before_the_storage(tmp_path: Path) -> None:
    cands = space()
    notices: list[str] = []
    with open_store(tmp_path, notice=notices.append) as store:
        store.open_study(settings(), [c.label() for c in cands])
        calls = 0

        def database_gone(*args, **kwargs):
            import sqlalchemy

            raise sqlalchemy.exc.OperationalError("UPDATE", {}, Exception("disk I/O error"))

        def run(c: Candidate) -> TrialResult:
            nonlocal calls
            calls += 1
            store.storage.set_trial_state_values = database_gone  # fails after the trial
            return TrialResult(candidate=c, status="ok", tokens_per_s=5.0)

        with pytest.raises(StorageError, match="disk I/O error"):
            run_trials(store, estimates(cands), run, n_trials=3)
    assert calls == 1 and len(journal(tmp_path)) == 1  # recorded all the same

    rerun = Runner()
    study(tmp_path, cands, rerun, n_trials=3, notices=notices)
    assert any("restored 1 trial records" in n for n in notices), notices
    assert journal(tmp_path)[0].candidate.label() not in rerun.calls
    assert len(rerun.calls) == 2


@pytest.mark.parametrize("damage", ["missing", "emptied", "corrupt"])
def test_a_lost_database_is_rebuilt_from_the_journal(tmp_path: Path, damage: str) -> None:
    cands = space()
    first = Runner()
    study(tmp_path, cands, first, n_trials=3)
    db = tmp_path / "study.db"
    if damage == "missing":
        db.unlink()
    elif damage == "emptied":
        db.write_bytes(b"")
    else:
        db.write_bytes(b"this is not a database" * 100)
    notices: list[str] = []
    rerun = Runner()
    _, results = study(tmp_path, cands, rerun, n_trials=5, notices=notices)
    assert not set(rerun.calls) & set(first.calls) and len(rerun.calls) == 2
    assert sum(r.status.launched for r in results) == 5
    assert any("restored 3 trial records" in n for n in notices), notices
    if damage == "corrupt":
        assert any("moved it to study.db.corrupt-" in n for n in notices)
        assert list(tmp_path.glob("study.db.corrupt-*"))


def test_a_partial_last_line_is_cut_before_appending(tmp_path: Path) -> None:
    cands = space()
    study(tmp_path, cands, Runner(), n_trials=2)
    log = tmp_path / "trials.jsonl"
    complete = log.read_bytes()
    with log.open("ab") as fh:
        fh.write(b'{"study":"autoshard-x","candidate":{"engi')  # killed mid-write
    notices: list[str] = []
    study(tmp_path, cands, Runner(), n_trials=3, notices=notices)
    assert [n for n in notices if "partial last record" in n] and len(notices) == 1
    assert log.read_bytes().startswith(complete)
    assert len(journal(tmp_path)) == 3  # every line a record, the new one on its own line


def test_a_bad_line_in_the_middle_is_one_line(tmp_path: Path) -> None:
    log = tmp_path / "trials.jsonl"
    log.write_text('{"study": "x"}\nnot json\n')
    with pytest.raises(StorageError, match=r"trials.jsonl:1: not a trial record"):
        study(tmp_path, space(), Runner(), n_trials=1)


# ---------------------------------------------------------------------------------------------
# The output folder's lock
# ---------------------------------------------------------------------------------------------

HOLD = """
import sys, time
from autoshard.study.lock import OutLock
with OutLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def hold_lock(folder: Path, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_on_the_same_out_refuses_naming_the_pid(tmp_path: Path) -> None:
    holder = hold_lock(tmp_path, 60)
    try:
        with pytest.raises(StudyLockedError) as info:
            open_store(tmp_path, notice=lambda _: None)
        assert info.value.pid == holder.pid
        message = str(info.value)
        assert f"PID {holder.pid}" in message and "--wait" in message and "\n" not in message
        # kill -9: the kernel drops the lock; the stale lock file is taken over.
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        with open_store(tmp_path, notice=lambda _: None) as store:
            assert json.loads(store.lock.path.read_text())["pid"] == os.getpid()
    finally:
        holder.kill()
        holder.wait()


def test_wait_starts_when_the_holder_ends(tmp_path: Path) -> None:
    holder = hold_lock(tmp_path, 1.5)
    notices: list[str] = []
    started = time.monotonic()
    with open_store(tmp_path, wait=True, notice=notices.append):
        waited = time.monotonic() - started
    holder.wait()
    assert 0.5 < waited < 30
    assert f"PID {holder.pid}" in notices[0] and "waiting" in notices[0]


def test_the_lock_is_released_by_close(tmp_path: Path) -> None:
    with OutLock(tmp_path):
        pass
    with OutLock(tmp_path):
        pass


# ---------------------------------------------------------------------------------------------
# Storage errors: one line each
# ---------------------------------------------------------------------------------------------


def test_a_full_disk_keeps_the_trial_that_just_ended(tmp_path: Path, monkeypatch) -> None:
    # A full device, simulated where the journal writes (a real one: test_study_slow.py).
    cands = space()
    real_write = os.write
    full = {"on": False}

    def write(fd: int, data) -> int:
        if full["on"] and not Path(f"/proc/self/fd/{fd}").resolve().name.startswith("."):
            import errno

            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    with open_store(tmp_path, notice=lambda _: None) as store:
        store.open_study(settings(), [c.label() for c in cands])

        def run(c: Candidate) -> TrialResult:
            full["on"] = True  # the disk fills during the trial
            return TrialResult(candidate=c, status="ok", tokens_per_s=5.0)

        monkeypatch.setattr(journal_mod.os, "write", write)
        # The reserve is given up; then the record fits (space freed by the reserve).
        real_release = store.journal._release_reserve

        def release() -> bool:
            full["on"] = False
            return real_release()

        store.journal._release_reserve = release  # type: ignore[method-assign]
        with pytest.raises(StorageError, match=r"no space left.*recorded in trials\.jsonl"):
            run_trials(store, estimates(cands), run, n_trials=3)
    monkeypatch.undo()
    assert len(journal(tmp_path)) == 1 and not (tmp_path / ".autoshard-reserve").exists()
    rerun = Runner()
    study(tmp_path, cands, rerun, n_trials=3)
    assert len(rerun.calls) == 2 and journal(tmp_path)[0].candidate.label() not in rerun.calls
    assert (tmp_path / ".autoshard-reserve").exists()  # kept again once there is room


@pytest.mark.parametrize(
    ("storage", "message"),
    [
        ("notaurl", "--storage 'notaurl': not a database URL"),
        ("sqlite:////nonexistent/x.db", "the folder /nonexistent does not exist"),
        ("sqlite://", "an in-memory database keeps nothing"),
        ("mssqlx://h/db", "unknown database kind"),
        ("postgresql://nobody@127.0.0.1:9/x", "postgresql://nobody@127.0.0.1:9/x: "),
    ],
)
def test_bad_storage_is_one_line(tmp_path: Path, storage: str, message: str) -> None:
    with (
        pytest.raises(StorageError) as info,
        open_store(tmp_path, storage, notice=lambda _: None) as store,
    ):
        store.open_study(settings(), [c.label() for c in space()])
    text = str(info.value)
    assert message in text and "\n" not in text, text


def test_postgresql_without_a_driver_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    from autoshard.errors import MissingDependencyError

    for module in ("psycopg", "psycopg2"):
        monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'autoshard\[postgres\]'"):
        open_store(tmp_path, "postgresql://me@db/x", notice=lambda _: None)


def test_out_naming_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StorageError, match=r"--out .*f: a file is in the way"):
        open_store(tmp_path / "f", notice=lambda _: None)
    with pytest.raises(StorageError, match="a file is in the way"):
        open_store(tmp_path / "f" / "sub", notice=lambda _: None)


def test_the_study_modules_examples_run() -> None:
    import autoshard.slurm
    import autoshard.study.database
    import autoshard.study.journal
    import autoshard.study.knobs
    import autoshard.study.lessons
    import autoshard.study.lock
    import autoshard.study.settings
    import autoshard.study.storage

    for module in (
        autoshard.slurm,
        autoshard.study.database,
        autoshard.study.journal,
        autoshard.study.knobs,
        autoshard.study.lessons,
        autoshard.study.lock,
        autoshard.study.settings,
    ):
        failures, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert failures == 0 and tried > 0, module.__name__


def test_import_autoshard_does_not_import_optuna() -> None:
    code = "import sys, autoshard; print('optuna' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# Read-only folders and files: a read-only mount (root ignores file modes), else file modes
# ---------------------------------------------------------------------------------------------


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def read_only(tmp_path: Path):
    """make(path): make a folder or file read-only for this process, undone after the test."""
    mounted: list[Path] = []

    def make(path: Path) -> None:
        if os.geteuid() != 0:
            path.chmod(0o555 if path.is_dir() else 0o444)
            return
        if not (_mount("--bind", str(path), str(path))):
            pytest.skip("root without mount: cannot make anything read-only here")
        mounted.append(path)
        if not _mount("-o", "remount,ro,bind", str(path)):
            pytest.skip("cannot remount read-only here")

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], capture_output=True)


def test_a_read_only_out_is_one_line(tmp_path: Path, read_only) -> None:
    out = tmp_path / "out"
    out.mkdir()
    read_only(out)
    with pytest.raises(StorageError) as info:
        open_store(out, notice=lambda _: None)
    assert f"--out {out}: cannot write there" in str(info.value) and "\n" not in str(info.value)


def test_a_read_only_study_db_is_one_line(tmp_path: Path, read_only) -> None:
    study(tmp_path, space(), Runner(), n_trials=1)
    read_only(tmp_path / "study.db")
    with pytest.raises(StorageError) as info:
        study(tmp_path, space(), Runner(), n_trials=2)
    text = str(info.value)
    assert "study.db" in text and "read-only" in text and "\n" not in text, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--storage", "notaurl"], "not a database URL"),
        (["--storage", "sqlite:////nonexistent/x.db"], "/nonexistent does not exist"),
        (["--storage", "postgresql://nobody@127.0.0.1:9/x"], "127.0.0.1:9/x: "),
        (["--out", "FILE"], "a file is in the way"),
        (["--trials", "0"], "--trials 0: give 1 or more"),
        # a time or a size is a finite number (issue 25, case 8)
        (["--trial-timeout", "inf"], "--trial-timeout inf: give a finite number"),
        (["--max-seconds", "nan"], "--max-seconds nan: give a finite number"),
        (["--target-spread", "nan"], "--target-spread nan: give a finite number"),
    ],
)
def test_storage_errors_through_the_command_line(cli, tmp_path: Path, args, message) -> None:
    (tmp_path / "FILE").write_text("x")
    args = [str(tmp_path / "FILE") if a == "FILE" else a for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    code, _, err = cli(
        "tune", "examples/gpt.py:build", "--arg", "size=tiny", "--gpu-memory", "1GiB", *args
    )
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err


def test_a_locked_out_through_the_command_line(cli, tmp_path: Path) -> None:
    holder = hold_lock(tmp_path, 60)
    try:
        code, _, err = cli(
            "tune", "examples/gpt.py:build", "--gpu-memory", "1GiB", "--out", str(tmp_path)
        )
    finally:
        holder.kill()
        holder.wait()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1 and f"PID {holder.pid}" in errors[0], err


# ---------------------------------------------------------------------------------------------
# SLURM
# ---------------------------------------------------------------------------------------------


def test_slurm_settings_from_the_environment(monkeypatch) -> None:
    from autoshard.errors import ConfigError
    from autoshard.slurm import parse_nodelist, slurm_settings

    monkeypatch.setenv("PATH", "")  # no scontrol: autoshard's own reading of the list
    assert slurm_settings({}) is None
    assert slurm_settings({"SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}) is None  # salloc, no srun
    step = {
        "SLURM_JOB_ID": "123456",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "big,gpu[010-012]",
        "SLURM_STEP_NODELIST": "gpu[009-012]",
    }
    assert slurm_settings(step) == {
        "nodes": 4,
        "node_rank": 2,
        "rdzv_endpoint": f"gpu009:{29500 + 123456 % 2000}",  # the step's first node
        "job_id": "123456",
    }
    assert slurm_settings({**step, "MASTER_PORT": "6000"})["rdzv_endpoint"] == "gpu009:6000"
    with pytest.raises(ConfigError, match="--ntasks-per-node=1"):
        slurm_settings({**step, "SLURM_NTASKS": "32"})
    with pytest.raises(ConfigError, match="no node list"):
        slurm_settings({k: v for k, v in step.items() if "NODELIST" not in k})
    assert parse_nodelist("n[1-3],m[08-10,15]") == ["n1", "n2", "n3", "m08", "m09", "m10", "m15"]
    assert parse_nodelist("r[1-2]-g[1-2]") == ["r1-g1", "r1-g2", "r2-g1", "r2-g2"]


def test_slurm_uses_scontrol_when_there(tmp_path: Path, monkeypatch) -> None:
    from autoshard.slurm import expand_nodelist

    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho first-host\necho second-host\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert expand_nodelist("whatever[1-2]") == ["first-host", "second-host"]


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 2 MiB tmpfs (root with mount only)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=2M", "tmpfs", str(disk)):
        pytest.skip("cannot mount a small tmpfs here")
    yield disk
    subprocess.run(["umount", str(disk)], capture_output=True)


def fill(folder: Path) -> Path:
    """Write until the device is full."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, os.urandom(4096))
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


@pytest.mark.parametrize("when", [1, 2])
def test_a_real_full_disk_keeps_the_trial_that_just_ended(small_disk: Path, when: int) -> None:
    # 1: the journal needs a new page for the record: the reserve makes room for it;
    # 2: the record fits in the journal's last page and the database is the first to fail.
    cands = space()
    fillers: list[Path] = []
    with open_store(small_disk, notice=lambda _: None) as store:
        store.open_study(settings(), [c.label() for c in cands])

        def run(c: Candidate) -> TrialResult:
            if not fillers and len(journal(small_disk)) == when - 1:
                fillers.append(fill(small_disk))  # the disk fills during this trial
            return TrialResult(candidate=c, status="ok", tokens_per_s=5.0)

        with pytest.raises(StorageError) as info:
            run_trials(store, estimates(cands), run, n_trials=4)
    text = str(info.value)
    assert "free some space" in text and "\n" not in text, text
    if when == 1:
        assert "recorded in trials.jsonl in the space autoshard kept in reserve" in text
    assert len(journal(small_disk)) == when  # every finished trial is recorded
    fillers[0].unlink()  # the user frees space
    rerun = Runner()
    _, results = study(small_disk, cands, rerun, n_trials=4)
    assert len(rerun.calls) == 4 - when
    assert not {r.candidate.label() for r in journal(small_disk)[:when]} & set(rerun.calls)
    assert sum(r.status.launched for r in results) == 4


def test_a_sqlite_storage_in_a_read_only_folder_is_one_line(tmp_path: Path, read_only) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    read_only(folder)
    with pytest.raises(StorageError) as info:
        open_store(tmp_path / "out", f"sqlite:///{folder}/x.db", notice=lambda _: None)
    assert "its folder must be writable" in str(info.value), info.value


# ---------------------------------------------------------------------------------------------
# A driver that is gone: its running trial is freed
# ---------------------------------------------------------------------------------------------

CLAIM_AND_HANG = """
import sys, time
sys.path.insert(0, sys.argv[3])
from tests.test_study import settings, space
from autoshard.study.storage import open_store
cands = space()
store = open_store(sys.argv[1], sys.argv[2], notice=lambda _: None)
store.open_study(settings(), [c.label() for c in cands])
with store.turn():
    store.start(cands[0].label())
print("claimed", flush=True)
time.sleep(600)
"""


def test_a_killed_drivers_candidate_is_run_by_another(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIM_AND_HANG, str(tmp_path / "gone"), storage, str(root)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    finally:
        proc.send_signal(signal.SIGKILL)  # kill -9 in the middle of its trial
        proc.wait()
    runner = Runner()
    started = time.monotonic()
    study(tmp_path / "alive", space(), runner, n_trials=3, storage=storage)
    # Same machine, process gone: freed at once (no heartbeat grace period to wait for).
    assert space()[0].label() in runner.calls and time.monotonic() - started < 20


def test_a_silent_driver_elsewhere_is_failed_after_the_grace_period(
    tmp_path: Path, monkeypatch
) -> None:
    from autoshard.study import storage as storage_mod

    # The grace period outlasts opening the second store under a loaded machine (with 1 s, the
    # first check below failed at load 11: the trial was already stale when first looked at).
    monkeypatch.setattr(storage_mod, "GRACE_S", 4)
    monkeypatch.setattr(storage_mod, "HEARTBEAT_S", 1)
    cands = space()
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    with open_store(tmp_path / "other", shared, notice=lambda _: None) as elsewhere:
        elsewhere.open_study(settings(), [c.label() for c in cands])
        elsewhere.host = "another-machine"  # as if that driver ran on another machine
        with elsewhere.turn():
            ticket = elsewhere.start(cands[0].label())
        elsewhere._stop_beat()  # its machine is lost: no more heartbeats
        with open_store(tmp_path / "here", shared, notice=lambda _: None) as here:
            here.open_study(settings(), [c.label() for c in cands])
            with here.turn() as view:
                assert cands[0].label() in view.running  # alive as far as anyone knows
            time.sleep(5)
            with here.turn() as view:
                assert cands[0].label() not in view.running  # failed: free again
        elsewhere._running = None
        assert ticket.trial_id >= 0


def test_a_full_disk_under_the_worker_group_is_one_line(tmp_path: Path, monkeypatch) -> None:
    # The worker group's control files are in --out/workers: a full disk there (seen in
    # benchmarks/faults_study.py) is a StorageError, and the interrupted trial runs again later.
    import errno

    import autoshard.search as search

    class FullDiskGroup:
        device = "cpu"

        def __init__(self, *args, **kwargs) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")  # its stop request too

        def run(self, *args, **kwargs) -> TrialResult:
            raise OSError(errno.ENOSPC, "No space left on device")

    import autoshard

    monkeypatch.setattr(search, "WorkerGroup", FullDiskGroup)
    with pytest.raises(StorageError) as info:
        autoshard.tune(
            TARGET, gpus=2, gpu="cpu-gloo", gpu_memory="4GiB", seq_len=8, batch_size=1,
            out_dir=tmp_path, trials=2, on_notice=lambda _: None,
        )  # fmt: skip
    text = str(info.value)
    assert "No space left on device while running a trial" in text and "\n" not in text
    assert journal(tmp_path) == [] or all(not r.status.launched for r in journal(tmp_path))


def test_hangs_are_one_failure_whatever_their_message_says() -> None:
    # A timeout's detail is the workers' last log line, e.g. an earlier trial's error (seen in
    # benchmarks/faults_study.py): two hangs still teach together.
    cands = space()
    a, b = [c for c in cands if c.micro_batch_size == 4 and c.precision.value == "32-true"][:2]
    hangs = [
        TrialResult(candidate=a, status="timeout", error="no result after 15.1 s; killed"),
        TrialResult(
            candidate=b, status="timeout", error="no result after 15.0 s; killed: RuntimeError: x"
        ),
    ]
    ok = TrialResult(candidate=cands[0], status="ok")  # 32-true, micro-batch 1
    untried = {c.label() for c in cands} - {a.label(), b.label(), ok.candidate.label()}
    ruled = learn(cands, [*hangs, ok], untried).ruled_out
    assert any("micro-batch >= 4" in why for why in ruled.values()), ruled


# ---------------------------------------------------------------------------------------------
# What a failure's signature keeps, and lessons about candidates outside the space
# (mutation survivors of autoshard.study.lessons)
# ---------------------------------------------------------------------------------------------


def test_a_failures_signature_blanks_its_numbers_and_keeps_its_words() -> None:
    from autoshard.study.lessons import describe, signature

    def failed(error: str | None) -> TrialResult:
        return TrialResult(candidate=Candidate(), status=TrialStatus.ERROR, error=error)

    text = "RuntimeError: Bad  shape at 0x7F3A in step 12,\n3.5 GiB on rank 1"
    assert (
        signature(failed(text)) == "error: runtimeerror: bad shape at # in step #, # gib on rank #"
    )
    assert signature(failed(text.replace("12", "99"))) == signature(failed(text))
    assert signature(failed(None)) == "error: "
    assert signature(failed("word " * 100)) == "error: " + ("word " * 100)[:240]
    assert describe({"precision": "32-true", "wrap": "none"}, 4) == (
        "precision=32-true, wrap=none, micro-batch >= 4"
    )
    assert describe({"precision": "32-true"}, None) == "precision=32-true"


def test_a_failure_outside_the_candidates_still_rules_out_its_larger_batches() -> None:
    # a failure recorded by an earlier study whose space held micro-batch 1: the same
    # configuration at a larger micro-batch is ruled out here too
    cands = [Candidate(precision="32-true", micro_batch_size=m) for m in (2, 4)]
    gone = Candidate(precision="32-true", micro_batch_size=1)
    bad = TrialResult(candidate=gone, status=TrialStatus.ERROR, error="RuntimeError: shape")
    lessons = learn(cands, [bad], [c.label() for c in cands])
    assert sorted(lessons.ruled_out) == sorted(c.label() for c in cands)


def test_a_failure_is_quoted_short_and_a_configuration_is_not_its_own_larger_batch() -> None:
    from autoshard.study.lessons import _short, _Space

    def failed(status: TrialStatus, error: str | None) -> TrialResult:
        return TrialResult(candidate=Candidate(), status=status, error=error)

    assert _short(failed(TrialStatus.TIMEOUT, None)) == "timeout"
    assert _short(failed(TrialStatus.ERROR, "RuntimeError:  bad\nshape")) == (
        "error: RuntimeError: bad shape"
    )
    long = "x" * 200
    assert _short(failed(TrialStatus.ERROR, long)) == "error: " + "x" * 117 + "..."
    assert _short(failed(TrialStatus.ERROR, "y" * 120)) == "error: " + "y" * 120
    small, big = Candidate(micro_batch_size=1), Candidate(micro_batch_size=2)
    space = _Space([small, big])
    assert space.larger_batch_of(big, small) and not space.larger_batch_of(small, small)
    assert not space.larger_batch_of(small, big)


def test_what_lessons_compare_and_advise_word_for_word() -> None:
    """A candidate's properties as the lessons compare and print them, a failure's cause with
    its paths left out, and the timeout advice naming the first failure's limit (mutation
    survivors of study/lessons, killed)."""
    from autoshard.config import Checkpointing, Sharding
    from autoshard.study.lessons import advice, cause, properties

    hybrid = Candidate(
        sharding=Sharding.HYBRID_SHARD, hybrid_mesh=(2, 4), wrap_classes=("a.Block", "a.Head"),
        checkpointing=Checkpointing.EVERY_K, checkpoint_every=2, checkpoint_classes=("a.Block",),
    )  # fmt: skip
    props = properties(hybrid)
    assert props["sharding"] == "HYBRID_SHARD 2x4"
    assert props["checkpointing"] == "every 2"
    assert props["wrap"] == "a.Block,a.Head"
    assert cause("rank 0: FileNotFoundError: /tmp/x/y.pt missing") == (
        "filenotfounderror: <path> missing"
    )
    timeouts = [
        TrialResult(candidate=Candidate(), status="timeout", error=f"no result after {t} s "
                    f"(trial timeout {t} s)")
        for t in (7, 9)
    ]  # fmt: skip
    assert advice(timeouts).startswith("raise --trial-timeout (7 s) if a trial needs longer")
