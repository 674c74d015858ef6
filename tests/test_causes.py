"""Failures by cause (issue 36): one from outside the model is tried again by the next run, with
the settings then in force; only the model's own counts against a configuration.

Trials are a function here (tests/test_study.py's Runner), so that this runs in seconds."""

from __future__ import annotations

from collections import Counter

import pytest

from autoshard.config import Candidate
from autoshard.results import TrialResult, TrialStatus
from autoshard.search import dominated_by
from autoshard.study.causes import CAUSES, Cause, cause_of, classified
from autoshard.study.lessons import learn

from .test_study import Runner, space, study

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
    }
    for cause, result in cases.items():
        assert cause_of(result) is cause, (cause, result.error)
    assert {k for k, v in CAUSES.items() if v.counts} == {Cause.MODEL, Cause.HANG, Cause.OOM}
    assert {k for k, v in CAUSES.items() if v.transient} == {
        Cause.SIGNAL,
        Cause.LAUNCH,
        Cause.DISK,
    }
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
