"""The worker group's deadlines and Ctrl-C, quickly, with a stand-in worker that needs no torch.
The protocol: tests/trials/test_protocol.py; the ranks' agreement and the worker's own logic:
tests/trials/test_worker.py; process lifetimes: tests/trials/test_lifeline.py; the capped log:
tests/trials/test_logcap.py; reading worker logs: tests/trials/test_crashlog.py; the ranks'
reports combined: tests/trials/test_accounting.py. The real groups are in trials/test_group.py
and test_faults.py (slow)."""

from __future__ import annotations

import _thread
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from autoshard.config import Candidate, WorkloadSpec
from autoshard.options import TuneOptions
from autoshard.results import TrialResult, TrialStatus
from autoshard.target.resolve import TargetSpec
from autoshard.trials.group import WorkerGroup

# --------------------------------------------------------------------------------------------
# Deadlines and Ctrl-C, with a stand-in worker group (a plain Python process, no torch)
# --------------------------------------------------------------------------------------------

# argv: control folder, start delay, what to do with a trial (ok / hang / exit)
STAND_IN = r"""
import json, os, sys, time
control, delay, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]

def put(name, data):  # atomically, as the workers do
    with open(os.path.join(control, name + ".tmp"), "w") as fh:
        json.dump(data, fh)
    os.replace(os.path.join(control, name + ".tmp"), os.path.join(control, name))

time.sleep(delay)
put("ready.json", {"world_size": 2})
n = 0
while True:
    path = os.path.join(control, f"request-{n}.json")
    while not os.path.exists(path):
        time.sleep(0.02)
    request = json.load(open(path))
    if request["kind"] == "stop":
        sys.exit(0)
    if mode == "hang":
        time.sleep(3600)
    if mode == "exit":
        sys.exit(3)
    result = {"n": n, "status": "ok", "world_size": 2, "step_times": [0.1], "step_time": 0.1}
    put(f"result-{n}.json", result)
    n += 1
"""


class StandInGroup(WorkerGroup):
    def __init__(
        self,
        tmp_path: Path,
        *,
        delay: float = 0.0,
        mode: str = "ok",
        trial_timeout: float = 300.0,
        start_timeout: float = 180.0,
    ) -> None:
        options = TuneOptions(nproc=2, trial_timeout=trial_timeout)
        super().__init__(
            TargetSpec(spec="m.py:build"), options, log_dir=tmp_path, start_timeout=start_timeout
        )
        self.delay, self.mode = delay, mode

    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN, str(self.control), str(self.delay), self.mode]


def _run(group: WorkerGroup) -> tuple[TrialResult, float]:
    started = time.monotonic()
    result = group.run(Candidate(), WorkloadSpec())
    return result, time.monotonic() - started


def test_the_trial_timeout_holds_for_the_first_trial_of_a_slow_starting_group(tmp_path) -> None:
    # The launch takes 2 s of its 60 s; the first trial hangs: it is timed from its request.
    group = StandInGroup(tmp_path, delay=2.0, mode="hang", trial_timeout=1.5, start_timeout=60)
    with group:
        result, took = _run(group)
    assert result.status is TrialStatus.TIMEOUT
    assert 1.5 <= result.duration < 2.5 and took < 5.5  # not 60 s of start timeout on top
    assert result.launch_seconds == group.launch_seconds and result.launch_seconds >= 2.0
    # the message says how long the trial really waited
    waited = re.search(r"no result after ([\d.]+) s \(trial timeout 1.5 s\)", result.error or "")
    assert waited and float(waited.group(1)) == pytest.approx(result.duration, abs=0.2)


def test_the_first_trial_after_a_relaunch_has_the_same_deadline(tmp_path) -> None:
    group = StandInGroup(tmp_path, mode="exit", trial_timeout=1.0, start_timeout=60)
    with group:
        crashed, _ = _run(group)
        assert crashed.status is TrialStatus.ERROR and not crashed.transient
        group.mode = "hang"
        hung, took = _run(group)  # the relaunched group's first trial
    assert group.launches == 2
    assert hung.status is TrialStatus.TIMEOUT and 1.0 <= hung.duration < 2.0 and took < 4


def test_a_launch_past_the_start_timeout_is_a_transient_failure(tmp_path) -> None:
    group = StandInGroup(tmp_path, delay=30.0, trial_timeout=60, start_timeout=1.0)
    with group:
        result, took = _run(group)
    assert result.status is TrialStatus.ERROR and result.transient
    assert "did not start within 1 s" in (result.error or "") and took < 3


def test_a_group_that_answers_runs_trial_after_trial_and_stops_cleanly(tmp_path) -> None:
    group = StandInGroup(tmp_path, trial_timeout=10)
    with group:
        results = [_run(group)[0] for _ in range(3)]
        proc = group.proc
    assert [r.status for r in results] == [TrialStatus.OK] * 3 and group.launches == 1
    assert results[0].launch_seconds > 0 and results[1].launch_seconds == 0  # (launched once)
    assert proc is not None and proc.returncode == 0  # the stop request, not a kill


def test_ctrl_c_during_a_hang_kills_the_group_at_once(tmp_path) -> None:
    group = StandInGroup(tmp_path, mode="hang", trial_timeout=600)
    threading.Timer(1.5, _thread.interrupt_main).start()  # Ctrl-C, 1.5 s into the trial
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), group:
        _run(group)
    assert time.monotonic() - started < 4
    assert group.proc is None  # killed and reaped, not waited for
