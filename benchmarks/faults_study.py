"""Benchmark: the study/storage rows of issue 15's fault matrix, run for real through
``autoshard tune`` (a tiny GPT, 2 gloo CPU processes, or 1 where two drivers share the cores).

    python benchmarks/faults_study.py [--only NAME ...] [--write benchmarks/results/faults_study.md]

Each row is a function ``case_*(work: Path) -> Row`` so that ``benchmarks/faults.py`` (the whole
matrix) can import and run them: ``from faults_study import CASES``. Columns:
- detect: seconds from the fault to the command's answer (the refusal, the error, the end);
- lost/rerun: finished trials missing from the record, plus trials that ran twice;
- left: processes still running with the output folder in their command line, 10 s later;
- exit: the command's exit code (after the fault; ``a/b`` for two commands);
- lines: what the user was shown about the fault (error lines, notices).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoshard.child_env import child_env  # noqa: E402
from autoshard.study.journal import read_records  # noqa: E402

GPT = ["examples/gpt.py:build", "--arg", "size=tiny", "--seq-len", "32"]
QUICK = ["--gpu-memory", "4GiB", "--precision", "32-true", "--steps", "2", "--warmup", "1"]
BASE = [*QUICK, "--batch-size", "1,2"]  # the baseline study's settings (enough candidates)
FAILING = "tests/targets/study_faults.py:build"
FAULTS = "tests/targets/faults.py:build"


@dataclass
class Row:
    case: str
    what: str
    detect: float | None
    lost_or_rerun: int | None
    left: int | None
    exit: str
    lines: str


def tune(
    *args: str, env: dict[str, str] | None = None, target: list[str] = GPT, front: tuple = ()
) -> Run:
    return Run([sys.executable, "-m", "autoshard", "tune", *target, *args], env, front)


class Run:
    """A command, started now."""

    def __init__(
        self, command: list[str], env: dict[str, str] | None = None, front: tuple = ()
    ) -> None:
        self.started = time.monotonic()
        full_env = child_env(*front, ROOT, **(env or {}))  # front: folders before the project
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.out = self.err = ""
        self.seconds = 0.0

    def wait(self, timeout: float = 600) -> Run:
        self.out, self.err = self.proc.communicate(timeout=timeout)
        self.seconds = time.monotonic() - self.started
        return self

    @property
    def code(self) -> int:
        return self.proc.returncode

    def shown(self) -> list[str]:
        """What the command said about trouble: errors, notices, tracebacks."""
        keep = ("error:", "Traceback", "StudyNotice", "warning:")
        return [line for line in self.err.splitlines() if line.startswith(keep) or "Notice" in line]


def launched(out: Path) -> list[str]:
    return [r.candidate.label() for r in read_records(out / "trials.jsonl") if r.status.launched]


def study_runs(out: Path) -> list[str]:
    """Every launched trial as "study label": a candidate measured again by a new study (a
    changed model) is no rerun."""
    lines = (
        (out / "trials.jsonl").read_text().splitlines() if (out / "trials.jsonl").exists() else []
    )
    records = [json.loads(line) for line in lines if line.strip()]
    return [
        f"{r['study']} {json.dumps(r['candidate'], sort_keys=True)}"
        for r in records
        if r["status"] in ("ok", "oom", "error", "timeout")
    ]


def twice(labels: list[str]) -> int:
    return sum(n - 1 for n in Counter(labels).values())


def lost_or_rerun(before: list[str], after: list[str]) -> int:
    """Trials recorded before that are gone, plus trials recorded twice."""
    return len(set(before) - set(after)) + twice(after)


def left(out: Path) -> int:
    time.sleep(10)
    found = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
    return len(found.split())


def describe(lines: list[str]) -> str:
    if not lines:
        return "0"
    first = lines[0].replace("|", "/")
    return f"{len(lines)}: {first[:150]}{'...' if len(first) > 150 else ''}"


def mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def baseline(work: Path) -> Path:
    """A finished study (3 trials) to damage; made once, copied by each case."""
    out = work / "baseline"
    if not (out / "recommendation.json").exists():
        run = tune(*BASE, "--trials", "3", "--out", str(out)).wait()
        assert run.code == 0, run.err[-2000:]
    return out


def copy_of(work: Path, name: str) -> Path:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(baseline(work), out, ignore=shutil.ignore_patterns("workers*"))
    return out


# ---------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------


def case_two_runs(work: Path) -> Row:
    out = work / "two-runs"
    first = tune(*BASE, "--trials", "3", "--out", str(out))
    deadline = time.monotonic() + 120
    while not list(out.glob("workers/group-*.log")) and time.monotonic() < deadline:
        time.sleep(0.2)  # the first run is in its first trial
    second = tune(*BASE, "--trials", "3", "--out", str(out)).wait()
    first.wait()
    ran = launched(out)
    return Row(
        "3", "a second `tune` on the same --out while the first runs a trial",
        second.seconds, (3 - len(set(ran))) + twice(ran), left(out),
        f"{first.code}/{second.code}", describe(second.shown()),
    )  # fmt: skip


def _one_line_case(case: str, what: str, args: list[str], front=()) -> Callable[[Path], Row]:
    def run_case(work: Path) -> Row:
        out = work / f"case-{abs(hash(what))}"
        real = [str(out) if a == "OUT" else a for a in args]
        if "--out" not in real:
            real += ["--out", str(out)]
        run = tune(*QUICK, *real, front=front).wait()
        return Row(case, what, run.seconds, 0, left(out), str(run.code), describe(run.shown()))

    return run_case


def case_out_is_a_file(work: Path) -> Row:
    (work / "a-file").write_text("x")
    return _one_line_case("5", "--out names a file", ["--out", str(work / "a-file")])(work)


def case_read_only_out(work: Path) -> Row:
    out = work / "read-only"
    out.mkdir(exist_ok=True)
    if not (mount("--bind", str(out), str(out)) and mount("-o", "remount,ro,bind", str(out))):
        return Row("5", "read-only --out", None, None, None, "-", "skipped: cannot mount")
    try:
        return _one_line_case("5", "read-only --out", ["--out", str(out)])(work)
    finally:
        subprocess.run(["umount", str(out)], capture_output=True)


def case_read_only_db(work: Path) -> Row:
    out = copy_of(work, "read-only-db")
    db = out / "study.db"
    if not (mount("--bind", str(db), str(db)) and mount("-o", "remount,ro,bind", str(db))):
        return Row("5", "read-only study.db", None, None, None, "-", "skipped: cannot mount")
    before = launched(out)
    try:
        run = tune(*BASE, "--trials", "4", "--out", str(out)).wait()
    finally:
        subprocess.run(["umount", str(db)], capture_output=True)
    return Row("5", "read-only study.db", run.seconds, lost_or_rerun(before, launched(out)),
               left(out), str(run.code), describe(run.shown()))  # fmt: skip


def case_corrupt_db(work: Path) -> Row:
    out = copy_of(work, "corrupt-db")
    (out / "study.db").write_bytes(b"garbage" * 1000)
    before = launched(out)
    run = tune(*BASE, "--trials", "3", "--out", str(out)).wait()
    after = launched(out)
    return Row("5", "corrupt study.db, same command again", run.seconds,
               lost_or_rerun(before, after) + len(after) - len(before), left(out), str(run.code),
               describe(run.shown()))  # fmt: skip


def case_full_disk(work: Path) -> Row:
    disk = work / "disk"
    disk.mkdir(exist_ok=True)
    if not mount("-t", "tmpfs", "-o", "size=4M", "tmpfs", str(disk)):
        return Row("5", "full disk during a trial", None, None, None, "-", "skipped: no tmpfs")
    try:
        out = disk / "out"
        run = tune(*BASE, "--trials", "3", "--out", str(out))
        deadline = time.monotonic() + 180
        while not launched(out) and time.monotonic() < deadline and run.proc.poll() is None:
            time.sleep(0.1)
        filled_at = time.monotonic()
        filler = disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, os.urandom(65536))
        except OSError:
            pass
        finally:
            os.close(fd)
        run.wait()
        detect = time.monotonic() - filled_at
        recorded = launched(out)
        filler.unlink()
        again = tune(*BASE, "--trials", "3", "--out", str(out)).wait()
        ran = launched(out)
        # lost: a trial that ran before the stop but is not recorded; rerun: recorded twice.
        lost = max(0, len(set(recorded)) - len(set(ran) & set(recorded)))
        return Row("5", "the disk fills during a trial; free it; same command again", detect,
                   lost + twice(ran), left(out), f"{run.code}/{again.code}",
                   describe(run.shown()))  # fmt: skip
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def case_storage_urls(work: Path) -> list[Row]:
    shim = work / "no-psycopg"
    shim.mkdir(exist_ok=True)
    for name in ("psycopg", "psycopg2"):
        (shim / f"{name}.py").write_text("raise ImportError('not installed')\n")
    no_driver = (shim,)  # before the installed drivers on the children's PYTHONPATH
    rows = []
    for url, front in [
        ("notaurl", ()),
        ("sqlite:////nonexistent/x.db", ()),
        ("postgresql://u@h/db", no_driver),
        ("postgresql://u@127.0.0.1:9/db", ()),
    ]:
        what = f"--storage {url}" + (" (no PostgreSQL driver)" if front else "")
        rows.append(_one_line_case("5", what, ["--storage", url], front)(work))
    return rows


def case_emptied_db(work: Path) -> Row:
    out = copy_of(work, "emptied-db")
    (out / "study.db").write_bytes(b"")
    before = launched(out)
    run = tune(*BASE, "--trials", "3", "--out", str(out)).wait()
    after = launched(out)
    return Row("6", "emptied study.db, same command again", run.seconds,
               lost_or_rerun(before, after) + len(after) - len(before), left(out), str(run.code),
               describe(run.shown()))  # fmt: skip


def case_partial_line(work: Path) -> Row:
    out = copy_of(work, "partial-line")
    with (out / "trials.jsonl").open("ab") as fh:
        fh.write(b'{"study":"autoshard-0","candidate":{"engine":"fs')
    before = launched(out)
    run = tune(*BASE, "--trials", "4", "--out", str(out)).wait()
    after = launched(out)  # raises if any line is not a record
    return Row("7", f"partial last line in trials.jsonl, --trials 4: {len(after)} recorded",
               run.seconds, lost_or_rerun(before, after), left(out), str(run.code),
               describe(run.shown()))  # fmt: skip


def _failing(work: Path, engine: str) -> Row:
    out = work / f"always-fails-{engine}"
    shutil.rmtree(out, ignore_errors=True)
    run = tune(
        "--arg", "fault=raise", "--seq-len", "16", "--gpu-memory", "4GiB", "--batch-size", "1,2",
        "--trials", "12", "--steps", "2", "--warmup", "1", "--engine", engine, "--out", str(out),
        target=[FAILING],
    ).wait()  # fmt: skip
    ran = launched(out)
    return Row("9", f"forward raises in every configuration ({engine}, --trials 12): "
               f"{len(ran)} trials", run.seconds, twice(ran), left(out), str(run.code),
               describe(run.shown()))  # fmt: skip


def case_always_fails(work: Path) -> list[Row]:
    return [_failing(work, "fsdp2"), _failing(work, "fsdp1")]


def case_hangs_from_4(work: Path) -> Row:
    """A forward that hangs at micro-batch 4 and above (--trial-timeout 15)."""
    out = work / "hangs"
    shutil.rmtree(out, ignore_errors=True)
    run = tune(
        "--arg", "fault=hang", "--seq-len", "16", "--gpu-memory", "4GiB", "--batch-size", "1,4",
        "--trials", "6", "--steps", "2", "--warmup", "1", "--trial-timeout", "15",
        "--out", str(out), target=[FAILING],
    ).wait(timeout=3600)  # fmt: skip
    records = read_records(out / "trials.jsonl")
    hangs = sum(r.status.value == "timeout" for r in records)
    skipped = sum(r.status.value == "skipped" for r in records)
    ran = launched(out)
    what = f"hang at micro-batch >= 4, --trials 6: {hangs} hung, {skipped} skipped"
    return Row("9", what, run.seconds, twice(ran), left(out), str(run.code),
               describe(run.shown()))  # fmt: skip


def case_changed_batch_sizes(work: Path) -> Row:
    out = work / "changed"
    shutil.rmtree(out, ignore_errors=True)
    first = tune(*QUICK, "--batch-size", "1,2", "--trials", "2", "--out", str(out), "--json").wait()
    second = tune(*QUICK, "--batch-size", "1", "--trials", "1", "--out", str(out), "--json").wait()
    rec = json.loads(second.out) if second.code == 0 else {}
    mbs = rec.get("chosen", {}).get("candidate", {}).get("micro_batch_size")
    report = json.loads((out / "report.json").read_text()) if second.code == 0 else {}
    own = {t["candidate"]["micro_batch_size"] for t in report.get("trials", [])}
    return Row("11", f"--batch-size 1 after 1,2: chose micro-batch {mbs}, report shows "
               f"micro-batches {sorted(own)}", second.seconds, twice(launched(out)), left(out),
               f"{first.code}/{second.code}", describe(second.shown()))  # fmt: skip


def case_trials_cap(work: Path) -> Row:
    out = work / "cap"
    shutil.rmtree(out, ignore_errors=True)
    run = tune(*QUICK, "--batch-size", "1,2", "--trials", "4", "--out", str(out)).wait()
    ran = launched(out)
    return Row("cap", f"--trials 4 launched {len(ran)}", run.seconds, twice(ran), left(out),
               str(run.code), describe(run.shown()))  # fmt: skip


def case_postgres(work: Path) -> Row:
    try:
        from tests.postgres import binaries, postgres_server
    except ImportError:
        return Row("many", "two drivers, one PostgreSQL study", None, None, None, "-", "skipped")
    if binaries() is None:
        return Row("many", "two drivers, one PostgreSQL study", None, None, None, "-", "no server")
    with postgres_server() as url:
        outs = [work / "pg-a", work / "pg-b"]
        for out in outs:
            shutil.rmtree(out, ignore_errors=True)
        args = [*QUICK, "--gpus", "1", "--batch-size", "1,2", "--precision", "bf16-mixed",
                "--trials", "4", "--storage", url]  # fmt: skip
        runs = [tune(*args, "--json", "--out", str(out)) for out in outs]
        for run in runs:
            run.wait()
        every = launched(outs[0]) + launched(outs[1])
        chosen = {
            json.dumps(json.loads(r.out)["chosen"]["candidate"], sort_keys=True)
            for r in runs
            if r.code == 0
        }
        wall = max(r.seconds for r in runs)
        return Row("many", f"two drivers, one PostgreSQL study, --trials 4: ran "
                   f"{len(launched(outs[0]))}+{len(launched(outs[1]))}, same choice: "
                   f"{len(chosen) == 1}", wall, twice(every),
                   left(outs[0]) + left(outs[1]), "/".join(str(r.code) for r in runs),
                   describe(runs[0].shown()))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Issue 25: a changed model, a meta-unsafe factory too large for the memory, PostgreSQL faults
# ---------------------------------------------------------------------------------------------

FAULTS_ARGS = ["--seq-len", "16", *QUICK, "--batch-size", "1", "--trials", "1"]


def case_changed_model(work: Path) -> list[Row]:
    """The model file made wider between two runs of the same command; then another target
    on the same --out."""
    model = work / "changed-model" / "model.py"
    model.parent.mkdir(parents=True, exist_ok=True)
    source = (ROOT / "tests" / "targets" / "faults.py").read_text()
    model.write_text(source)
    out = work / "changed-model" / "out"
    shutil.rmtree(out, ignore_errors=True)
    first = tune(*FAULTS_ARGS, "--out", str(out), target=[f"{model}:build"]).wait()
    model.write_text(source.replace("width: int = 32", "width: int = 64"))
    second = tune(*FAULTS_ARGS, "--out", str(out), target=[f"{model}:build"]).wait()
    resumed = second.err.count("resumed")
    notes = [line for line in second.err.splitlines() if "new study" in line]
    ran = launched(out)
    rows = [
        Row("25.1", f"model file made wider, same command: {resumed} resumed, "
            f"{len(ran) - 1} new trial", second.seconds, twice(study_runs(out)), left(out),
            f"{first.code}/{second.code}", describe(notes)),
    ]  # fmt: skip
    other = tune(*FAULTS_ARGS, "--out", str(out), target=[FAILING]).wait()
    notes = [line for line in other.err.splitlines() if "another target" in line]
    again = twice(study_runs(out))
    rows.append(Row("25.1", "another target on the same --out", other.seconds, again, left(out),
                    str(other.code), describe(notes)))  # fmt: skip
    return rows


def case_meta_unsafe(work: Path) -> Row:
    """30 x Linear(1024, 1024) reading a weight after each, with 64 MiB free (the size limit
    the benchmark sets: AUTOSHARD_AVAILABLE_MEMORY)."""
    run = Run(
        [sys.executable, "-m", "autoshard", "analyze", "tests/targets/meta_unsafe.py:build"],
        env={"AUTOSHARD_AVAILABLE_MEMORY": "64MiB"},
    ).wait()
    errors = [line for line in run.err.splitlines() if line.startswith("error:")]
    return Row("25.2", "a factory that cannot build on meta, 120 MiB, 64 MiB free",
               run.seconds, 0, 0, str(run.code), describe(errors))  # fmt: skip


HOLDER = """
import sys
from autoshard.study.claims import ClaimLock
lock = ClaimLock(sys.argv[1])
lock.__enter__()
print("holding", flush=True)
sys.stdin.readline()
"""


def case_postgres_faults(work: Path) -> list[Row]:
    try:
        from tests.postgres import binaries, postgres_instance
    except ImportError:
        return [Row("25.3", "PostgreSQL faults", None, None, None, "-", "skipped")]
    if binaries() is None:
        return [Row("25.3", "PostgreSQL faults", None, None, None, "-", "no server")]
    from autoshard.study.database import check_storage

    rows = []
    with postgres_instance() as server:
        # A restart mid-trial: down for 10 s while the trial ends.
        out = work / "pg-restart"
        shutil.rmtree(out, ignore_errors=True)
        run = tune(*FAULTS_ARGS, "--arg", "fault=slow", "--arg", "seconds=4", "--storage",
                   server.url, "--out", str(out), target=[FAULTS])  # fmt: skip
        deadline = time.monotonic() + 300
        while not list(out.glob("workers/group-*/request-0.json")):
            assert time.monotonic() < deadline and run.proc.poll() is None, "no trial"
            time.sleep(0.1)
        server.stop()
        down = time.monotonic()
        time.sleep(10)
        server.start()
        run.wait()
        notes = [line for line in run.err.splitlines() if "connection" in line]
        what = f"PostgreSQL restarted mid-trial (down 10 s): {len(launched(out))} trial recorded"
        rows.append(Row("25.4", what, time.monotonic() - down, twice(launched(out)), left(out),
                        str(run.code), describe(notes)))  # fmt: skip
        # A driver stopped by SIGSTOP while it holds the claim.
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, check_storage(server.url)], cwd=ROOT,
            env=child_env(ROOT), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
            os.kill(holder.pid, signal.SIGSTOP)
            out = work / "pg-stopped"
            shutil.rmtree(out, ignore_errors=True)
            run = tune(*FAULTS_ARGS, "--storage", server.url, "--out", str(out),
                       target=[FAULTS]).wait()  # fmt: skip
            notes = [line for line in run.err.splitlines() if "claim" in line]
            rows.append(Row("25.3", "a driver stopped (SIGSTOP) while it holds the claim: "
                            f"{len(launched(out))} trial ran", run.seconds, twice(launched(out)),
                            left(out), str(run.code), describe(notes)))  # fmt: skip
        finally:
            holder.kill()
    return rows


CASES: dict[str, Callable[[Path], Row | list[Row]]] = {
    "two_runs": case_two_runs,
    "out_is_a_file": case_out_is_a_file,
    "read_only_out": case_read_only_out,
    "read_only_db": case_read_only_db,
    "corrupt_db": case_corrupt_db,
    "full_disk": case_full_disk,
    "storage_urls": case_storage_urls,
    "emptied_db": case_emptied_db,
    "partial_line": case_partial_line,
    "always_fails": case_always_fails,
    "changed_batch_sizes": case_changed_batch_sizes,
    "trials_cap": case_trials_cap,
    "postgres": case_postgres,
    "hangs_from_4": case_hangs_from_4,  # slow before the start-timeout fix (issue 15, case 1)
    "changed_model": case_changed_model,
    "meta_unsafe": case_meta_unsafe,
    "postgres_faults": case_postgres_faults,
}


def table(rows: list[Row]) -> str:
    def fmt(v: object) -> str:
        if v is None:
            return "-"
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    head = "| case | fault | detect (s) | lost/rerun | left | exit | lines shown |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        cells = [r.case, r.what, r.detect, r.lost_or_rerun, r.left, r.exit, r.lines]
        lines.append("| " + " | ".join(fmt(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument("--write", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="autoshard-faults-study-"))
    rows: list[Row] = []
    for name, case in CASES.items():
        if args.only and name not in args.only:
            continue
        started = time.monotonic()
        got = case(work)
        rows.extend(got if isinstance(got, list) else [got])
        print(f"{name}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.write:
        command = "python benchmarks/faults_study.py" + (
            f" --only {' '.join(args.only)}" if args.only else ""
        )
        args.write.write_text(
            "# Fault matrix: the study and storage rows (issue 15)\n\n"
            f"`{command}` on {os.cpu_count()} CPU cores, no GPU (2 gloo CPU processes per "
            "worker group; 1 per driver in the PostgreSQL row).\n\n" + text + "\n"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
