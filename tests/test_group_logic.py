"""The worker group's logic, quickly: the typed protocol, the atomic writer, the ranks'
agreement on a trial's outcome, deadlines and Ctrl-C (with a stand-in worker that needs no
torch), and process lifetimes. Reading worker logs: tests/trials/test_crashlog.py; the ranks'
reports combined: tests/trials/test_accounting.py. The real groups are in test_group.py and
test_faults.py (slow)."""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from autoshard.child_env import child_env
from autoshard.config import Candidate, WorkloadSpec
from autoshard.options import TuneOptions
from autoshard.results import TrialResult, TrialStatus
from autoshard.target.resolve import TargetSpec
from autoshard.trials.accounting import summarize
from autoshard.trials.group import WorkerGroup
from autoshard.trials.lifeline import alive, parent_death_preexec
from autoshard.trials.protocol import (
    Launch,
    RankReport,
    StopRequest,
    TrialReply,
    TrialRequest,
    parse_request,
    read_message,
    write_json_atomically,
)
from autoshard.trials.worker import agree

# --------------------------------------------------------------------------------------------
# The protocol
# --------------------------------------------------------------------------------------------


def _request(n: int = 0) -> TrialRequest:
    return TrialRequest(
        n=n,
        candidate=Candidate(precision="32-true", micro_batch_size=2),
        target=TargetSpec(spec="m.py:build", kwargs={"size": "tiny"}),
        workload=WorkloadSpec(seq_len=64),
        memory_cap=2**30,
    )


def test_requests_round_trip_through_their_files(tmp_path) -> None:
    for message in (_request(3), StopRequest(n=4)):
        write_json_atomically(tmp_path / "request.json", message)
        assert parse_request((tmp_path / "request.json").read_text()) == message
    reply = TrialReply(n=1, status="ok", world_size=2, step_times=(0.1, 0.2), step_time=0.15)
    write_json_atomically(tmp_path / "result.json", reply)
    assert read_message(tmp_path / "result.json", TrialReply) == reply


def test_messages_refuse_what_they_do_not_know() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        parse_request('{"kind": "trial", "n": 0}')  # no candidate, target, workload
    with pytest.raises(ValidationError):
        parse_request(json.dumps({"kind": "stop", "n": 0, "now": True}))  # extra field
    with pytest.raises(ValidationError):
        parse_request('{"kind": "reboot", "n": 0}')


def test_a_reader_never_sees_part_of_a_file_being_written(tmp_path) -> None:
    path, big = tmp_path / "result.json", {"losses": [0.123456789] * 50_000}
    write_json_atomically(path, big)
    done, partial = threading.Event(), []

    def write() -> None:
        for _ in range(40):
            write_json_atomically(path, big)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    while not done.is_set():
        try:
            json.loads(path.read_text())
        except json.JSONDecodeError:
            partial.append(1)
    writer.join()
    assert not partial


def test_the_atomic_writer_leaves_no_part_and_keeps_the_old_file_on_failure(tmp_path) -> None:
    path = tmp_path / "x.json"
    write_json_atomically(path, {"a": 1})
    write_json_atomically(path, Launch(driver_pid=1, collective_timeout=5))
    assert read_message(path, Launch).driver_pid == 1
    with pytest.raises(TypeError):
        write_json_atomically(path, {"not json": object()})
    assert read_message(path, Launch).driver_pid == 1  # the last good content, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]  # no temporary left


# --------------------------------------------------------------------------------------------
# Ranks agreeing on a trial's outcome (through a store, not a collective)
# --------------------------------------------------------------------------------------------


def _report(rank: int, ok: bool, at: float = 0.0) -> RankReport:
    if ok:
        return RankReport(rank=rank, status="ok", step_times=(0.1,), samples=2)
    return RankReport(rank=rank, status="error", error=f"E{rank}", failed_at=at)


def test_ranks_that_all_fail_go_on_together() -> None:
    store, outcomes = dist.HashStore(), {}

    def rank(r: int) -> None:
        time.sleep(0.3 * r)  # the second rank fails a little later
        outcomes[r] = agree(store, "t0", _report(r, ok=False), 2, timeout=5)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes == {0: True, 1: True}


def test_a_rank_that_fails_alone_knows_within_its_timeout() -> None:
    store = dist.HashStore()
    started = time.monotonic()
    assert agree(store, "t0", _report(1, ok=False), 2, timeout=0.5) is False  # rank 0 stuck
    assert 0.5 <= time.monotonic() - started < 2
    # a rank that finished the trial passed every collective: it does not wait
    started = time.monotonic()
    assert agree(store, "t1", _report(0, ok=True), 2, timeout=30) is True
    assert time.monotonic() - started < 1


def test_the_first_failure_is_the_trials_error_whichever_rank() -> None:
    request = TrialRequest(n=0, candidate=Candidate(), target=TargetSpec(spec="m:b"),
                           workload=WorkloadSpec())  # fmt: skip
    reply = summarize(request, [_report(0, ok=False, at=20.0), _report(1, ok=False, at=10.0)])
    assert reply.status is TrialStatus.ERROR and reply.error == "rank 1: E1"
    ok = summarize(
        request,
        [
            RankReport(rank=0, status="ok", step_times=(0.1, 0.3), samples=2, allocated=5),
            RankReport(rank=1, status="ok", step_times=(0.2, 0.1), samples=2, allocated=7),
        ],
    )
    assert ok.step_times == (0.2, 0.3) and ok.peak_allocated == (5, 7)
    assert ok.samples_per_s == pytest.approx(4 / 0.25)


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


# --------------------------------------------------------------------------------------------
# Process lifetimes
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_the_parent_death_signal_dies_with_its_parent(tmp_path) -> None:
    # parent: starts a long sleep with the preexec hook, prints its pid, waits
    parent_code = (
        "import subprocess, sys, time\n"
        "from autoshard.trials.lifeline import parent_death_preexec\n"
        "child = subprocess.Popen(['sleep', '600'], preexec_fn=parent_death_preexec())\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = child_env(*sys.path)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, env=env)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert alive(child)
        parent.kill()  # kill -9: no cleanup runs in the parent
        parent.wait()
        deadline = time.monotonic() + 5
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert parent_death_preexec() is not None  # the main thread may ask for it...
    elsewhere: list[object] = []
    thread = threading.Thread(target=lambda: elsewhere.append(parent_death_preexec()))
    thread.start()
    thread.join()
    assert elsewhere == [None]  # ...another thread may not: its end would kill the child


def test_the_watchdog_ends_a_worker_whose_driver_is_gone() -> None:
    driver = subprocess.Popen(["sleep", "600"])
    code = (
        "import os, sys, time\n"
        "from autoshard.trials.lifeline import start_watchdog\n"
        f"start_watchdog({driver.pid}, os.getppid(), every=0.1)\n"
        "print('watching', flush=True)\n"
        "time.sleep(600)\n"  # the main thread is busy: the watchdog does not need it
    )
    env = child_env(*sys.path)
    worker = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == b"watching\n"
        time.sleep(0.5)
        assert worker.poll() is None
        driver.kill()
        driver.wait()
        assert worker.wait(timeout=5) == 1
        assert worker.stderr is not None and b"is gone: exiting" in worker.stderr.read()
    finally:
        worker.kill()
        driver.kill()


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child of init may linger as one for a moment)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# --------------------------------------------------------------------------------------------
# The worker log, capped per trial (issue 25, case 5)
# --------------------------------------------------------------------------------------------


def test_a_capped_log_keeps_each_trials_head_and_tail(tmp_path) -> None:
    from autoshard.trials.logcap import CappedLog, marker, read_tail

    path, cap = tmp_path / "group.log", 1000
    log = CappedLog(path, cap)
    first = b"".join(f"{n:05d}\n".encode() for n in range(2000))  # 12,000 bytes
    for at in range(0, len(first), 77):
        log.write(first[at : at + 77])
    log.new_section()
    log.write(b"second trial\n")
    log.close()
    text = path.read_bytes()
    head, _, rest = text.partition(b"\n[autoshard: ")
    assert head == first[:500]  # the first half of the cap
    kept_tail = rest.split(b"(--worker-log-cap)]\n", 1)[1].removesuffix(b"second trial\n")
    assert first.endswith(kept_tail) and len(kept_tail) >= 500
    left_out = len(first) - 500 - len(kept_tail)
    assert marker(left_out, cap) in text  # says exactly how much is missing
    assert text.endswith(b"second trial\n")  # the next trial's output is kept from its start
    assert len(text) < 500 + 2 * cap
    assert read_tail(path, 13) == b"second trial\n"


# --------------------------------------------------------------------------------------------
# A trial's result accounting (no process started): tokens, samples, status precedence
# --------------------------------------------------------------------------------------------


def test_the_trials_result_keeps_the_first_failures_traceback_and_rank_0s_counts() -> None:
    from autoshard.measure import median_spread
    from autoshard.trials.worker import failure_path, published_failures, target_shape

    request = _request()
    # a failure whose time is unknown counts as the first; its traceback is the trial's
    unknown = RankReport(rank=1, status="error", error="E1", traceback="Traceback: one")
    timed = RankReport(rank=0, status="error", error="E0", traceback="Traceback: zero",
                       failed_at=0.5)  # fmt: skip
    reply = summarize(request, [timed, unknown])
    assert reply.error == "rank 1: E1" and reply.traceback == "Traceback: one"
    # every rank times the same steps: a mismatch is a bug, not something to average away
    uneven = [
        RankReport(rank=0, status="ok", step_times=(0.1, 0.2), samples=2),
        RankReport(rank=1, status="ok", step_times=(0.1,), samples=2),
    ]
    with pytest.raises(ValueError):
        summarize(request, uneven)
    # one rank: its own counts, spread, memory and losses
    times = (0.30, 0.20, 0.25, 0.26, 0.24, 0.27, 0.5)
    alone = RankReport(rank=0, status="ok", step_times=times, samples=4, tokens=256,
                       allocated=5, reserved=9, losses=(2.0, 1.5))  # fmt: skip
    reply = summarize(request, [alone])
    assert reply.step_time_spread == pytest.approx(median_spread(times)) and reply.step_time_spread
    assert reply.tokens_per_s == pytest.approx(256 / 0.26)
    assert (reply.peak_allocated, reply.peak_reserved) == ((5,), (9,))
    assert reply.losses == (2.0, 1.5)
    two = summarize(request, [alone, alone.model_copy(update={"rank": 1, "reserved": 11,
                                                              "losses": (9.0, 9.0)})])  # fmt: skip
    assert two.peak_reserved == (9, 11) and two.losses == (2.0, 1.5)  # rank 0's losses
    # where a failure is kept for the driver, what each rank published, what a warm-up keys on
    assert failure_path(Path("/c"), 3, 1) == Path("/c/failed-3-rank1.json")
    store = dist.HashStore()
    store.set("t/0", _report(0, ok=True).model_dump_json())
    store.set("t/2", _report(2, ok=False).model_dump_json())
    assert [r.rank for r in published_failures(store, "t", 3)] == [2]
    assert target_shape(request) == (request.target, request.candidate.precision, 2, 64)


def test_a_failure_is_one_line_naming_its_exception() -> None:
    from autoshard.trials.worker import _one_line

    assert _one_line(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert _one_line(RuntimeError("x" * 900)) == "RuntimeError: " + "x" * 486
    assert _one_line(KeyError()) == "KeyError:"


def test_the_atomic_writer_reports_a_missing_folder_and_survives_an_unsyncable_one(
    tmp_path, monkeypatch
) -> None:
    # nothing was written, so nothing is left to remove: the writer's own error, not a cleanup's
    with pytest.raises(FileNotFoundError):
        write_json_atomically(tmp_path / "missing" / "result-0.json", {"n": 0})

    # a folder that cannot be opened for its sync (Windows): the file is written all the same
    def no_folder(*args: object, **kwargs: object) -> int:
        raise OSError("cannot open a folder")

    monkeypatch.setattr(os, "open", no_folder)
    write_json_atomically(tmp_path / "result-1.json", {"n": 1, "error": "CUDA — 2 GiB"})
    monkeypatch.undo()
    assert json.loads((tmp_path / "result-1.json").read_text(encoding="utf-8"))["n"] == 1
