"""Benchmark: the fault matrix. Every fault a study must survive, injected for real into
`autoshard tune` (or a worker group), one row each.

    python benchmarks/faults.py [--only CASE ...] [--write benchmarks/results/faults.md]

The model is tests/targets/faults.py (a small token model that hangs, raises, exits or kills
itself on demand, in trial workers only); 2 gloo CPU processes. Columns:

- time to detect: seconds from the fault to the study reporting it (a hang: the trial's wall
  time against its --trial-timeout);
- trials lost or rerun: finished trials missing from trials.jsonl, or run twice;
- processes left: processes of the study (found by its output folder in their command line)
  still running 10 s after the study ended or its driver was killed;
- exit code of the command; lines shown: the lines the user saw on stderr (after Ctrl-C, for
  that case), and the last one.

Adding a row: write a function that takes a fresh folder and returns a :class:`Row`, and
decorate it with ``@case("name", "what it injects")``. Rows are run in the order defined.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

from autoshard.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]
FAULTS = f"{ROOT}/tests/targets/faults.py:build"
TIMEOUT = 10.0  # --trial-timeout of the hang cases
SETTLE = 10.0  # processes still running this long after the end count as left behind


@dataclass
class Row:
    case: str
    detect: str  # "12.3 s (timeout 10)", "-", ...
    lost_or_rerun: str
    processes_left: int
    exit_code: int | str | None  # "1/0": two commands
    lines: list[str] = field(default_factory=list)
    passed: bool = True
    note: str = ""


@dataclass
class Case:
    name: str
    summary: str
    run: Callable[[Path], Row]


CASES: list[Case] = []


def case(name: str, summary: str) -> Callable[[Callable[[Path], Row]], Callable[[Path], Row]]:
    def register(fn: Callable[[Path], Row]) -> Callable[[Path], Row]:
        CASES.append(Case(name, summary, fn))
        return fn

    return register


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def tune_command(out: Path, *args: str, trials: int = 1, timeout: float = TIMEOUT) -> list[str]:
    return [
        sys.executable, "-m", "autoshard", "tune", FAULTS, *args,
        "--seq-len", "16", "--gpu-memory", "4GiB", "--precision", "32-true",
        "--trials", str(trials), "--trial-timeout", str(timeout),
        "--warmup", "1", "--steps", "2", "--out", str(out),
    ]  # fmt: skip


def fault_args(**kwargs: object) -> list[str]:
    return [item for k, v in kwargs.items() for item in ("--arg", f"{k}={v}")]


def study_processes(marker: Path) -> list[int]:
    found = subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def left_after(marker: Path, settle: float = SETTLE) -> int:
    deadline = time.monotonic() + settle
    while study_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = study_processes(marker)
    for pid in left:  # never leave them to the next case
        subprocess.run(["kill", "-9", str(pid)], capture_output=True)
    return len(left)


def trials(out: Path) -> list[dict]:
    log = out / "trials.jsonl"
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [t for t in rows if t["status"] not in ("pruned", "skipped")]  # the launched ones


def shown(stderr: str) -> list[str]:
    return [line.strip() for line in stderr.splitlines() if line.strip()]


def wait_for_trial(out: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not any(out.glob("workers/group-*/request-0.json")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no trial started in {out}")
        time.sleep(0.1)


def reruns(records: list[dict]) -> int:
    labels = [json.dumps(t["candidate"], sort_keys=True) for t in records]
    return len(labels) - len(set(labels))


# --------------------------------------------------------------------------------------------
# The cases of the worker group (issue 15: 1, 2, 4, 8, 10, and a transient crash)
# --------------------------------------------------------------------------------------------


def _hang(folder: Path, rank: int, batch_sizes: str, n: int) -> Row:
    out = folder / "out"
    command = tune_command(
        out, *fault_args(fault="hang", rank=rank), "--batch-size", batch_sizes, trials=n
    )
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    records = trials(out)
    durations = [t["duration"] for t in records]
    worst = max(durations, default=float("nan"))
    return Row(
        case="",
        detect=f"{worst:.1f} s worst of {len(records)} (timeout {TIMEOUT:g})",
        lost_or_rerun=f"{reruns(records)} rerun",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=shown(done.stderr),
        passed=bool(records)
        and all(t["status"] == "timeout" for t in records)
        and worst <= TIMEOUT + 5,
    )


@case("hang, first trial of every group", "rank 1 hangs, rank 0 waits in a collective; 2 trials")
def hang_first_trial(folder: Path) -> Row:
    return _hang(folder, rank=1, batch_sizes="1,2", n=2)


@case("hang after a crash relaunch", "rank 1 exits (code 3), then the next trial hangs")
def hang_after_relaunch(folder: Path) -> Row:
    # the worker group directly: the order of the two faults must be fixed
    script = textwrap.dedent(
        f"""
        import json, sys, time
        from pathlib import Path
        from autoshard.config import Candidate, WorkloadSpec
        from autoshard.options import TuneOptions
        from autoshard.target.resolve import TargetSpec
        from autoshard.trials.group import WorkerGroup
        c = Candidate(wrap_classes=("faults.Block",), precision="32-true")
        def t(**kw):
            return TargetSpec(spec={FAULTS!r}, kwargs=kw)
        w = WorkloadSpec(seq_len=16)
        o = TuneOptions(nproc=2, trial_timeout={TIMEOUT}, warmup=1, steps=2)
        with WorkerGroup(t(), o, log_dir=Path(sys.argv[1])) as g:
            a = g.run(c, w, target=t(fault="exit", rank=1))
            b = g.run(c, w, target=t(fault="hang", rank=1))
            print(json.dumps([a.model_dump(mode="json"), b.model_dump(mode="json"), g.launches]))
        """
    )
    out = folder / "out"
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    crashed, hung, launches = json.loads(done.stdout.splitlines()[-1])
    return Row(
        case="",
        detect=f"{hung['duration']:.1f} s (timeout {TIMEOUT:g})",
        lost_or_rerun="0",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=[crashed["error"], hung["error"]],
        passed=crashed["status"] == "error"
        and hung["status"] == "timeout"
        and hung["duration"] <= TIMEOUT + 5
        and launches == 2,
    )


IDLE_DRIVER = """
import sys, time
from pathlib import Path
from autoshard.config import Candidate, WorkloadSpec
from autoshard.options import TuneOptions
from autoshard.target.resolve import TargetSpec
from autoshard.trials.group import WorkerGroup
options = TuneOptions(nproc=2, warmup=1, steps=1)
group = WorkerGroup(TargetSpec(spec=sys.argv[1]), options, log_dir=Path(sys.argv[2]))
result = group.run(Candidate(wrap_classes=("faults.Block",), precision="32-true"),
                   WorkloadSpec(seq_len=16))
print(result.status.value, flush=True)
time.sleep(3600)
"""


def _kill_driver(folder: Path, state: str) -> Row:
    out = folder / "out"
    if state == "idle":
        driver = subprocess.Popen(
            [sys.executable, "-c", IDLE_DRIVER, FAULTS, str(out)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert driver.stdout is not None
        driver.stdout.readline()
    else:
        fault = (
            fault_args(fault="slow", seconds=60)
            if state == "mid-trial"
            else fault_args(fault="hang", rank=1)
        )
        driver = subprocess.Popen(
            tune_command(out, *fault, timeout=300),
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for_trial(out)
        time.sleep(3)
    before = len(study_processes(out))
    driver.kill()
    driver.wait()
    killed = time.monotonic()
    while study_processes(out) and time.monotonic() - killed < SETTLE:
        time.sleep(0.1)
    gone = time.monotonic() - killed
    left = left_after(out, settle=0)
    return Row(
        case="",
        detect=f"all {before - 1} gone in {gone:.1f} s" if not left else "-",
        lost_or_rerun="- (a trial in flight dies with its driver)",
        processes_left=left,
        exit_code=-9,
        passed=left == 0 and before >= 4,
    )


@case("kill -9 of the driver, group idle", "between trials")
def kill_idle(folder: Path) -> Row:
    return _kill_driver(folder, "idle")


@case("kill -9 of the driver, mid-trial", "both ranks busy in a step")
def kill_mid_trial(folder: Path) -> Row:
    return _kill_driver(folder, "mid-trial")


@case("kill -9 of the driver, trial hung", "rank 0 waits in a collective for rank 1")
def kill_hung(folder: Path) -> Row:
    return _kill_driver(folder, "hung")


@case("exception on one rank only", "rank 1 raises in step 2; rank 0 waits in a collective")
def rank_only_exception(folder: Path) -> Row:
    out = folder / "out"
    message = "rank one alone fails"
    command = tune_command(
        out, *fault_args(fault="raise", rank=1, step=2, message=repr(message)), timeout=120
    )
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    records = trials(out)
    error = records[0]["error"] if records else ""
    return Row(
        case="",
        detect=f"{records[0]['duration']:.1f} s (timeout 120)" if records else "-",
        lost_or_rerun=f"{reruns(records)} rerun",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=shown(done.stderr),
        passed=bool(records) and error == f"rank 1: RuntimeError: {message}",
    )


@case("Ctrl-C during a hang", "SIGINT to the driver 3 s into a hung trial")
def ctrl_c(folder: Path) -> Row:
    out = folder / "out"
    driver = subprocess.Popen(
        tune_command(out, *fault_args(fault="hang", rank=1), timeout=300),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    timed: list[tuple[float, str]] = []  # stderr's lines and when they came
    assert driver.stderr is not None
    stream = driver.stderr
    reader = threading.Thread(
        target=lambda: timed.extend((time.monotonic(), line.strip()) for line in stream)
    )
    reader.start()
    wait_for_trial(out)
    time.sleep(3)
    sent = time.monotonic()
    driver.send_signal(signal.SIGINT)
    driver.wait(timeout=60)
    took = time.monotonic() - sent
    reader.join()
    lines = [text for at, text in timed if at >= sent and text]  # shown after Ctrl-C
    return Row(
        case="",
        detect=f"exited {took:.1f} s after Ctrl-C",
        lost_or_rerun="-",
        processes_left=left_after(out),
        exit_code=driver.returncode,
        lines=lines,
        passed=took < 3 and driver.returncode == 130 and lines[-1:] == ["interrupted"],
    )


@case("a rank killed by a signal", "rank 1 SIGKILLs itself (as the OOM killer would)")
def rank_killed(folder: Path) -> Row:
    out = folder / "out"
    command = tune_command(out, *fault_args(fault="kill", rank=1), timeout=120)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    records = trials(out)
    return Row(
        case="",
        detect=f"{records[0]['duration']:.1f} s" if records else "-",
        lost_or_rerun=f"{reruns(records)} rerun",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=shown(done.stderr),
        passed=bool(records) and bool(records[0].get("transient")),
        note="transient: " + str(bool(records and records[0].get("transient"))),
    )


# --------------------------------------------------------------------------------------------
# Issue 25: signals, a model's own exit, bounded logs, finite numbers, --json
# --------------------------------------------------------------------------------------------


def _sigterm_to(folder: Path, who: str) -> Row:
    """SIGTERM to torchrun or a worker 3 s into a trial that sleeps 8 s: a transient crash,
    retried once, and the retry runs fine."""
    out = folder / "out"
    run = subprocess.Popen(
        tune_command(out, *fault_args(fault="slow", seconds=8), timeout=120),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for_trial(out)
    time.sleep(3)
    launcher = next(
        int(line.split()[0])
        for line in subprocess.run(
            ["pgrep", "-af", "torch.distributed.run"], capture_output=True, text=True
        ).stdout.splitlines()
        if str(out) in line
    )
    workers = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
    target = launcher if who == "torchrun" else int(workers.stdout.split()[-1])
    sent = time.monotonic()
    subprocess.run(["kill", "-TERM", str(target)])
    _, stderr = run.communicate(timeout=600)
    records = trials(out)
    first = records[0] if records else {}
    then = records[-1]["status"] if records else "-"
    return Row(
        case="",
        detect=f"{first.get('duration', float('nan')):.1f} s, retried",
        lost_or_rerun=f"{reruns(records) - 1} rerun besides the retry",
        processes_left=left_after(out),
        exit_code=run.returncode,
        lines=[first.get("error") or "", *shown(stderr)][:1],
        passed=len(records) == 2
        and bool(first.get("transient"))
        and records[1]["status"] == "ok"
        and run.returncode == 0
        and time.monotonic() - sent < 120,
        note=f"transient: {bool(first.get('transient'))}, then {then}",
    )


@case("SIGTERM to torchrun", "kill -TERM of the launcher 3 s into a trial")
def sigterm_launcher(folder: Path) -> Row:
    return _sigterm_to(folder, "torchrun")


@case("SIGTERM to a worker", "kill -TERM of rank 1 3 s into a trial")
def sigterm_worker(folder: Path) -> Row:
    return _sigterm_to(folder, "worker")


@case("SIGTERM to the driver", "SIGTERM to `autoshard tune` 3 s into a hung trial")
def sigterm_driver(folder: Path) -> Row:
    out = folder / "out"
    driver = subprocess.Popen(
        tune_command(out, *fault_args(fault="hang", rank=1), timeout=300),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    timed: list[tuple[float, str]] = []
    assert driver.stderr is not None
    stream = driver.stderr
    reader = threading.Thread(
        target=lambda: timed.extend((time.monotonic(), line.strip()) for line in stream)
    )
    reader.start()
    wait_for_trial(out)
    time.sleep(3)
    sent = time.monotonic()
    driver.send_signal(signal.SIGTERM)
    driver.wait(timeout=60)
    took = time.monotonic() - sent
    reader.join()
    lines = [text for at, text in timed if at >= sent and text]
    return Row(
        case="",
        detect=f"exited {took:.1f} s after SIGTERM",
        lost_or_rerun="- (the running trial marked failed)",
        processes_left=left_after(out),
        exit_code=driver.returncode,
        lines=lines,
        passed=took < 10 and driver.returncode == 143 and lines == ["terminated (SIGTERM)"],
    )


@case("argparse in the factory", "workers parse their own --control flags: exit code 2")
def argparse_factory(folder: Path) -> Row:
    out = folder / "out"
    command = tune_command(out, "--arg", "argv=True", "--batch-size", "1,2", trials=6)
    command += ["--precision", "bf16-mixed"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    records = [t for t in trials(out) if t["status"] in ("error", "timeout", "ok", "oom")]
    last = shown(done.stderr)[-1:] or [""]
    return Row(
        case="",
        detect=f"stopped after {len(records)} trials",
        lost_or_rerun=f"{reruns(records)} rerun",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=shown(done.stderr),
        passed=len(records) == 2
        and "unrecognized arguments: --control" in last[0]
        and "SystemExit: exit code 2, called at faults.py" in last[0],
    )


@case("a model printing 100 KB per forward", "--worker-log-cap 1MiB")
def spam(folder: Path) -> Row:
    out = folder / "out"
    command = tune_command(out, *fault_args(spam=100_000), "--worker-log-cap", "1MiB", timeout=120)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    logs = list(out.glob("workers/group-*.log"))
    size = sum(p.stat().st_size for p in logs)
    capped = any(b"left out here" in p.read_bytes() for p in logs)
    return Row(
        case="",
        detect=f"log {size / 2**20:.2f} MiB for 1 trial",
        lost_or_rerun="0",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=shown(done.stderr)[-1:],
        passed=done.returncode == 0 and capped and size < 2 * 2**20,
    )


@case("--trial-timeout inf", "an infinite time")
def infinite_timeout(folder: Path) -> Row:
    out = folder / "out"
    started = time.monotonic()
    done = subprocess.run(
        tune_command(out, timeout=float("inf")), cwd=ROOT, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    lines = shown(done.stderr)
    return Row(
        case="",
        detect=f"{time.monotonic() - started:.1f} s",
        lost_or_rerun="0",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=lines,
        passed=done.returncode == 1 and len(lines) == 1 and "finite" in lines[0],
    )


@case("--trial-timeout 1", "every trial times out: the advice names the flag")
def short_timeout(folder: Path) -> Row:
    out = folder / "out"
    command = tune_command(out, "--batch-size", "1,2", trials=4, timeout=1)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = shown(done.stderr)
    return Row(
        case="",
        detect=f"{len(trials(out))} trials",
        lost_or_rerun=f"{reruns(trials(out))} rerun",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=lines,
        passed=done.returncode == 1 and "raise --trial-timeout (1 s)" in (lines[-1:] or [""])[0],
    )


@case("a factory that prints, tune --json", "print() in the factory, in the driver and workers")
def json_stdout(folder: Path) -> Row:
    out = folder / "out"
    command = [*tune_command(out, "--arg", "noise=True", timeout=120), "--json"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    try:
        valid = bool(json.loads(done.stdout).get("chosen"))
    except ValueError:
        valid = False
    return Row(
        case="",
        detect="-",
        lost_or_rerun="0",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=[f"stdout is JSON: {valid}"],
        passed=valid and done.returncode == 0,
    )


# --------------------------------------------------------------------------------------------
# Issue 36: diverged losses, failures by cause, secrets, temp files, fingerprints, listeners
# --------------------------------------------------------------------------------------------

QUICK = ["--no-compile", "--max-steps", "3"]  # fewer candidates and steps: these rows are long


def _tune(out: Path, *args: str, env: dict[str, str] | None = None, trials: int = 1,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(
        tune_command(out, *QUICK, *args, trials=trials, timeout=timeout), cwd=ROOT,
        capture_output=True, text=True, timeout=1200, env=child_env(**(env or {})),
    )  # fmt: skip


def _one_line(args: list[str], expect: str, command: str = "tune") -> Row:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "autoshard", command, *args], cwd=ROOT, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    lines = shown(done.stderr)
    errors = [line for line in lines if line.startswith("error:")]
    return Row(
        case="",
        detect=f"{time.monotonic() - started:.1f} s",
        lost_or_rerun="-",
        processes_left=0,
        exit_code=done.returncode,
        lines=errors or lines[-1:],
        passed=done.returncode == 1
        and len(errors) == 1
        and expect in errors[0]
        and "Traceback" not in done.stderr,
    )


@case("a NaN loss at micro-batch 2", "the model's logits become NaN from step 2 at mbs 2")
def nan_loss(folder: Path) -> Row:
    out = folder / "out"
    done = _tune(out, *fault_args(fault="nan", batch=2, step=2), "--batch-size", "1,2", trials=4)
    records = trials(out)
    diverged = [t for t in records if t["status"] == "diverged"]
    ok = [t for t in records if t["status"] == "ok"]
    said = next((line for line in shown(done.stdout) if "diverged" in line), "")
    return Row(
        case="",
        detect=f"{len(diverged)} diverged, {len(ok)} measured",
        lost_or_rerun=f"{reruns(records)} rerun",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=[said or (shown(done.stderr) or [""])[-1]],
        passed=done.returncode == 0
        and bool(diverged)
        and bool(ok)
        and all(t["candidate"]["micro_batch_size"] == 2 for t in diverged)
        and all(t["step_times"] for t in diverged),
    )


@case("a full disk in the workers, then the same command", "OSError ENOSPC in every forward")
def disk_full_then_rerun(folder: Path) -> Row:
    out = folder / "out"
    first = _tune(out, "--batch-size", "1", env={"FAULTS_DISK_FULL": "1"})
    before = trials(out)
    again = _tune(out, "--batch-size", "1")
    after = trials(out)
    ran_again = [t for t in after[len(before) :] if t["status"] == "ok"]
    return Row(
        case="",
        detect=f"{len(before)} failed (transient: {all(t['transient'] for t in before)}), "
        f"then {len(ran_again)} ran",
        lost_or_rerun="the failed one retried",
        processes_left=left_after(out),
        exit_code=f"{first.returncode}/{again.returncode}",
        lines=shown(first.stderr)[-1:],
        passed=first.returncode == 1
        and again.returncode == 0
        and bool(ran_again)
        and "free space on the disk" in (shown(first.stderr) or [""])[-1],
    )


def _report_of_schema_999(folder: Path) -> list[str]:
    report = folder / "report.json"
    report.write_text(json.dumps({"schema": 999, "recommendation": {}, "trials": []}))
    return [str(report)]


def _tune_args(*args: str, timeout: float = TIMEOUT) -> Callable[[Path], list[str]]:
    return lambda folder: tune_command(folder / "out", *args, timeout=timeout)[4:]


# Bad input refused in one line: (case, summary, command, its arguments in a folder, the line's
# words). Each row: exit 1, one "error:" line saying that, no traceback.
ONE_LINE_CASES: list[tuple[str, str, str, Callable[[Path], list[str]], str]] = [
    ("--trial-timeout 1e30", "a time past what the OS takes", "tune",
     _tune_args(timeout=1e30), "give 1000000 or less"),
    ("--accumulate 99999999999", "an absurd accumulation", "tune",
     _tune_args("--accumulate", "99999999999"), "--accumulate 99999999999: give 4096 or less"),
    ("--accumulate 1000000", "an accumulation that grew to 6.5 GB", "tune",
     _tune_args("--accumulate", "1000000"), "--accumulate 1000000: give 4096 or less"),
    ("estimate --simulate 99999", "more simulations than candidates", "estimate",
     lambda _: [FAULTS, "--seq-len", "16", "--gpus", "2", "--gpu-memory", "4GiB", "--simulate",
                "99999"], "fitting candidates can be simulated"),
    ("export of a report with schema 999", "a report of another schema, a number", "export",
     _report_of_schema_999, "is not one this autoshard reads"),
    ("--storage mysql://... without its driver", "the package pip installs", "tune",
     _tune_args("--storage", "mysql://u:pw@127.0.0.1/x"), "pip install mysqlclient"),
]  # fmt: skip
for _name, _summary, _command, _args, _expect in ONE_LINE_CASES:
    CASES.append(
        Case(
            _name,
            _summary,
            lambda folder, c=_command, a=_args, e=_expect: _one_line(a(folder), e, c),
        )
    )


@case("--storage postgresql://user:PASSWORD@...", "a real PostgreSQL; every file under --out")
def password_on_disk(folder: Path) -> Row:
    sys.path.insert(0, str(ROOT))
    from tests.postgres import binaries, postgres_instance

    if binaries() is None:
        return Row("", "-", "-", 0, None, ["no PostgreSQL binaries"], False)
    secret = "S3cret-Pa55word"
    out = folder / "out"
    with postgres_instance() as server:
        url = server.url.replace("autoshard@", f"autoshard:{secret}@")
        run = subprocess.Popen(
            tune_command(out, *QUICK, *fault_args(fault="slow", seconds=3), "--storage", url,
                         timeout=120),
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        wait_for_trial(out)
        during = _holding(out, secret)
        lock_mode = oct((out / "autoshard.lock").stat().st_mode & 0o777)
        _, stderr = run.communicate(timeout=1200)
    after = _holding(out, secret)
    return Row(
        case="",
        detect=f"{len(during)} files during, {len(after)} after; lock {lock_mode}",
        lost_or_rerun="0",
        processes_left=left_after(out),
        exit_code=run.returncode,
        lines=[*during, *after] or ["no file holds the password"],
        passed=run.returncode == 0
        and not during
        and not after
        and lock_mode == "0o600"
        and secret not in stderr,
    )


def _holding(folder: Path, secret: str) -> list[str]:
    return [
        str(p.relative_to(folder)) for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink() and secret.encode() in p.read_bytes()
    ]  # fmt: skip


PLANTED = """
import os, sys, tempfile, torch
from pathlib import Path
from torch import nn
import autoshard
from autoshard.target import adapters
shared, victim, marker = map(Path, sys.argv[1:4])
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
planted = shared / "autoshard-targets"
planted.mkdir()
planted.chmod(0o777)  # made by another user, for the victim to write into
(planted / f"model-{adapters._digest_module(model)}.pt").symlink_to(victim)
class Hostile:
    def __reduce__(self):
        return (Path(marker).write_text, ("unpickled",))
bad = planted / "model-from-another-user.pt"
torch.save({"model": Hostile(), "batch": None}, bad)
rec = autoshard.recommend(model, batch=torch.randn(2, 8), gpus=2, gpu_memory="8GiB")
refused = 0
try:
    adapters.load_saved_model(str(bad))
except autoshard.AutoshardError:
    refused = 1
print(victim.read_text() == "precious", not marker.exists(), refused, rec.chosen.candidate.label())
"""


@case("a planted symlink in $TMPDIR/autoshard-targets", "another user's folder, symlink, pickle")
def planted_symlink(folder: Path) -> Row:
    shared, victim, marker = folder / "tmp", folder / "victim", folder / "ran"
    shared.mkdir()
    victim.write_text("precious")
    done = subprocess.run(
        [sys.executable, "-c", PLANTED, str(shared), str(victim), str(marker)], cwd=ROOT,
        capture_output=True, text=True, timeout=600, env=child_env(TMPDIR=str(shared)),
    )  # fmt: skip
    said = (shown(done.stdout) or [""])[-1]
    return Row(
        case="",
        detect="-",
        lost_or_rerun="-",
        processes_left=0,
        exit_code=done.returncode,
        lines=[f"victim intact, nothing unpickled, shared pickle refused: {said}"],
        passed=done.returncode == 0 and said.startswith("True True 1 "),
    )


@case("an edited forward: x = block(block(x))", "the same --out, parameters unchanged")
def edited_forward(folder: Path) -> Row:
    model, out = folder / "model.py", folder / "out"
    source = (ROOT / "tests" / "targets" / "faults.py").read_text()
    model.write_text(source)
    command = [*tune_command(out, *QUICK, "--batch-size", "1", timeout=120)[4:]]
    command[0] = f"{model}:build"

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "autoshard", "tune", *command], cwd=ROOT,
                              capture_output=True, text=True, timeout=1200)  # fmt: skip

    first = run()
    model.write_text(source.replace("x = block(x)\n", "x = block(block(x))\n"))
    second = run()
    notes = [line for line in shown(second.stderr) if "new study" in line]
    return Row(
        case="",
        detect=f"{len(trials(out))} trials, in {len({t['study'] for t in trials(out)})} studies",
        lost_or_rerun="0 resumed",
        processes_left=left_after(out),
        exit_code=f"{first.returncode}/{second.returncode}",
        lines=notes,
        passed=first.returncode == second.returncode == 0
        and len(notes) == 1
        and "the model's forward" in notes[0]
        and "resumed" not in second.stderr,
    )


@case("listeners of a single-node tune", "every listening socket of the study's processes")
def listeners(folder: Path) -> Row:
    import psutil

    out = folder / "out"
    run = subprocess.Popen(
        tune_command(out, *QUICK, *fault_args(fault="slow", seconds=4), timeout=120), cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for_trial(out)
    time.sleep(1)
    pids = {run.pid, *study_processes(out)}
    found = [
        f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]  # fmt: skip
    run.wait(timeout=1200)
    public = [a for a in found if not a.startswith(("127.0.0.1:", "::1:"))]
    return Row(
        case="",
        detect=f"{len(found)} listening, {len(public)} beyond loopback",
        lost_or_rerun="0",
        processes_left=left_after(out),
        exit_code=run.returncode,
        lines=[", ".join(found)],
        passed=run.returncode == 0 and bool(found) and not public,
    )


@case("a factory that hangs 15 s in the driver", "time.sleep in the factory, driver only")
def factory_hangs(folder: Path) -> Row:
    out = folder / "out"
    run = subprocess.Popen(
        tune_command(out, *QUICK, *fault_args(build_seconds=15), timeout=120), cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    started = time.monotonic()
    assert run.stderr is not None
    timed = [(time.monotonic() - started, line.strip()) for line in run.stderr]
    run.wait()
    said = [(at, text) for at, text in timed if "has not returned" in text]
    return Row(
        case="",
        detect=f"said after {said[0][0]:.1f} s" if said else "not said",
        lost_or_rerun="0",
        processes_left=left_after(out),
        exit_code=run.returncode,
        lines=[text for _, text in said],
        passed=run.returncode == 0 and len(said) == 1 and "in build" in said[0][1],
    )


@case("a trial printing 1.3 x the log cap", "--worker-log-cap 1MiB; 12 forwards of 115 KB")
def log_between_caps(folder: Path) -> Row:
    out = folder / "out"
    done = _tune(out, *fault_args(spam=115_000), "--worker-log-cap", "1MiB", "--max-steps", "2",
                 "--steps", "2", "--warmup", "1")  # fmt: skip
    logs = list(out.glob("workers/group-*.log"))
    sizes = [p.stat().st_size for p in logs]
    marked = all(b"left out here" in p.read_bytes() for p in logs if p.stat().st_size > 2**20)
    return Row(
        case="",
        detect=f"largest log {max(sizes, default=0) / 2**20:.2f} MiB",
        lost_or_rerun="0",
        processes_left=left_after(out),
        exit_code=done.returncode,
        lines=shown(done.stderr)[-1:],
        passed=done.returncode == 0 and max(sizes, default=0) <= 2**20 + 300 and marked,
    )


@case("a deleted trials.jsonl, same command again", "rm trials.jsonl between two runs")
def deleted_journal(folder: Path) -> Row:
    out = folder / "out"
    first = _tune(out, "--batch-size", "1", trials=2)
    before = trials(out)
    (out / "trials.jsonl").unlink()
    again = _tune(out, "--batch-size", "1", trials=2)
    after = trials(out)
    said = [line for line in shown(again.stderr) if "written back" in line]
    return Row(
        case="",
        detect=f"{len(after)} of {len(before)} records back",
        lost_or_rerun=f"{len(before) - len(after)} lost",
        processes_left=left_after(out),
        exit_code=f"{first.returncode}/{again.returncode}",
        lines=said,
        passed=again.returncode == 0 and len(after) == len(before) > 0 and len(said) == 1,
    )


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


def _cell(text: str, width: int = 110) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def table(rows: list[Row]) -> str:
    head = (
        "| case | time to detect | trials lost or rerun | processes left | exit code "
        "| lines shown (last) | as it should |\n| --- | --- | --- | ---: | ---: | --- | --- |"
    )
    body = [
        f"| {r.case} | {r.detect} | {r.lost_or_rerun} | {r.processes_left} | {r.exit_code} "
        f"| {len(r.lines)}: {_cell(r.lines[-1] if r.lines else '')}"
        f"{(' (' + r.note + ')') if r.note else ''} | {'yes' if r.passed else 'NO'} |"
        for r in rows
    ]
    return "\n".join([head, *body])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only the cases whose name contains this")
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    chosen = [c for c in CASES if not args.only or any(o in c.name for o in args.only)]
    rows = []
    for c in chosen:
        print(f"running: {c.name} ({c.summary})", file=sys.stderr, flush=True)
        with TemporaryDirectory(prefix="autoshard-faults-") as tmp:
            try:
                row = c.run(Path(tmp))
            except Exception as exc:  # a case that breaks is a row that says so
                row = Row("", "-", "-", left_after(Path(tmp)), None, [repr(exc)], False)
        row.case = c.name
        rows.append(row)
    text = table(rows)
    print(text)
    if args.write:
        command = "python benchmarks/faults.py" + (
            " --only " + shlex.join(args.only) if args.only else ""
        )
        args.write.write_text(
            f"# Fault matrix\n\n`{command} --write {args.write}`\n\n"
            f"2 gloo CPU processes, tests/targets/faults.py; hang cases with --trial-timeout "
            f"{TIMEOUT:g}; processes counted {SETTLE:g} s after the end.\n\n{text}\n\n"
            "As it should: a hang reported within the trial timeout + 5 s, as a timeout; no "
            "process left; an exception on one rank reported with its message, not as a hang; "
            "Ctrl-C answered in under 3 s with one line and exit code 130; a rank killed by a "
            "signal reported as transient; SIGTERM to torchrun or a worker transient and retried "
            "once, to the driver one line and exit code 143; a model's own exit reported with its "
            "code, frame and message, the study stopped after 2 trials; worker logs bounded; "
            "inf refused in one line; advice that matches the cause; stdout valid JSON. "
            "Issue 36: a NaN loss a diverged trial, the study going on to a measured choice; a "
            "failure from outside the model retried by the next run; values that cannot work "
            "one line each; no file under --out holding the storage password, the lock 0600; "
            "nothing written through a planted symlink nor unpickled from a shared folder; an "
            "edited forward a new study; nothing listening beyond loopback; a factory's hang "
            "said; a trial's log within its cap with a marker; a deleted journal written back.\n"
        )
    sys.exit(0 if all(r.passed for r in rows) else 1)


if __name__ == "__main__":
    main()
