"""The study's helpers for quick tests, and what is left of its storage side here: the output
folder's lock, the study modules' examples, SLURM.

Trials here are a function (the loop's `run`), so that the study's tests run in seconds: the
helpers below (space, settings, Runner, study, journal) serve tests/study/test_settings.py,
test_loop.py, test_lessons.py, test_storage.py and test_causes.py, and test_recommendation.py.
The same loop with real worker groups is exercised by tests/test_search.py and
tests/test_study_slow.py.
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

from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.errors import StudyLockedError
from autoshard.results import MemoryBreakdown, MemoryEstimate, TrialResult
from autoshard.study.journal import read_records
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
# The study modules' examples, and optuna imported only when a study runs
# ---------------------------------------------------------------------------------------------


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
