"""The study's storage side with real trials (slow): several drivers sharing one study in a
real PostgreSQL server, and changed settings through the command line (issue 15, case 11)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from autoshard.config import Candidate
from autoshard.study.journal import read_records

from .conftest import EXAMPLES, ROOT
from .postgres import PostgresServer, binaries, postgres_instance

pytestmark = pytest.mark.slow

TINY = [f"{EXAMPLES}/gpt.py:build", "--arg", "size=tiny", "--seq-len", "32"]
QUICK = ["--gpu-memory", "4GiB", "--precision", "32-true", "--steps", "2", "--warmup", "1"]


def tune(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autoshard", "tune", *TINY, *QUICK, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launched(out: Path, study: str | None = None) -> list[str]:
    return [
        r.candidate.label() for r in read_records(out / "trials.jsonl", study) if r.status.launched
    ]


# ---------------------------------------------------------------------------------------------
# A real PostgreSQL server
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    """A PostgreSQL server of its own (tests/postgres.py)."""
    pytest.importorskip("psycopg")
    if binaries() is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) on this machine")
    with postgres_instance() as running:
        yield running


@pytest.fixture
def postgres(server: PostgresServer) -> str:
    """Its URL."""
    return server.url


def test_two_drivers_share_one_postgresql_study(postgres: str, tmp_path: Path) -> None:
    """Two `autoshard tune` processes (own worker groups, own output folders), one study in
    PostgreSQL: no candidate runs twice, --trials counts both, both end with the same choice."""
    # Two precisions and two micro-batches: four candidates that no measured one dominates, so
    # that --trials 4 is reached whatever the order in which the drivers finish.
    args = ["--gpus", "1", "--batch-size", "1,2", "--precision", "bf16-mixed", "--trials", "4",
            "--storage", postgres, "--json"]  # fmt: skip
    command = [sys.executable, "-m", "autoshard", "tune", *TINY, *QUICK, *args]
    drivers = {
        name: subprocess.Popen(
            [*command, "--out", str(tmp_path / name)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("a", "b")
    }
    outputs = {name: p.communicate(timeout=500) for name, p in drivers.items()}
    for name, p in drivers.items():
        assert p.returncode == 0, outputs[name][1][-3000:]
    recs = {name: json.loads(out) for name, (out, _) in outputs.items()}

    ran = {name: launched(tmp_path / name) for name in drivers}
    assert ran["a"] and ran["b"], ran  # both drivers ran trials
    every = ran["a"] + ran["b"]
    assert len(every) == len(set(every)) == 4, ran  # none twice; the cap counts both
    chosen = {name: Candidate.model_validate(r["chosen"]["candidate"]) for name, r in recs.items()}
    assert chosen["a"] == chosen["b"]
    assert recs["a"]["study"] == recs["b"]["study"]
    # Both decided on all four trials, whichever driver ran them.
    for rec in recs.values():
        tried = [rec["chosen"], *rec["runners_up"], *rec["ruled_out"]]
        labels = {Candidate.model_validate(s["candidate"]).label() for s in tried if s["trial"]}
        assert set(every) <= labels

    # The study in the database: one finished trial per candidate.
    import optuna

    study = optuna.load_study(study_name=recs["a"]["study"], storage=recs_url(postgres))
    per_candidate = Counter(
        t.user_attrs["candidate"]  # the label; the parameters are the knobs
        for t in study.get_trials(deepcopy=False)
        if t.state.is_finished()
    )
    assert max(per_candidate.values()) == 1


FAULTS = ["tests/targets/faults.py:build", "--seq-len", "16"]


def faults_tune(out: Path, storage: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "autoshard", "tune", *FAULTS, *QUICK, "--batch-size", "1",
         "--trials", "1", "--storage", storage, "--out", str(out), "--json", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_postgresql_restart_mid_trial_is_ridden_out(server: PostgresServer, tmp_path) -> None:
    """The server stops while a trial runs, the trial ends while it is down, and it is back
    10 s later: the driver reconnects with back-off, records the trial, and ends normally
    (issue 25, case 4)."""
    out = tmp_path / "out"
    driver = faults_tune(out, server.url, "--arg", "fault=slow", "--arg", "seconds=4")
    try:
        wait_for(lambda: any(out.glob("workers/group-*/request-0.json")), 300, "the trial")
        server.stop()
        time.sleep(10)  # the trial (8 s of sleeps) ends while the server is down
        server.start()
        stdout, stderr = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 0, stderr[-3000:]
    assert "lost the connection to the database" in stderr and "reconnected after" in stderr
    assert "Traceback" not in stderr
    ran = launched(out)
    assert len(ran) == 1, ran  # recorded once, not rerun
    import optuna

    study = optuna.load_study(study_name=json.loads(stdout)["study"], storage=recs_url(server.url))
    states = [t.state.name for t in study.get_trials(deepcopy=False)]
    assert states.count("COMPLETE") == 1 and "RUNNING" not in states, states


HOLDER = """
import sys, time
from autoshard.study.claims import ClaimLock
from autoshard.study.view import ClaimLost
lock = ClaimLock(sys.argv[1])
lock.__enter__()
print("holding", flush=True)
sys.stdin.readline()  # stopped here; continued, it looks at its claim
try:
    lock.check()
    print("still held", flush=True)
except ClaimLost:
    print("lost", flush=True)
"""


def test_a_driver_stopped_while_it_holds_the_claim_does_not_wedge_the_study(
    postgres: str, tmp_path: Path
) -> None:
    """A driver holds the claim; another says whom it waits for; the holder is stopped by
    SIGSTOP: within STALE_S it is taken for dead, its session ended, and the study runs; the
    stopped one, continued, finds its claim gone (issue 25, case 3)."""
    from autoshard.study.claims import STALE_S

    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER), recs_url(postgres)], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    driver = None
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        driver = faults_tune(tmp_path / "out", postgres)
        said: list[tuple[float, str]] = []
        reader = threading.Thread(
            target=lambda: said.extend((time.monotonic(), line) for line in driver.stderr)
        )
        reader.start()
        wait_for(lambda: any("waiting for driver" in line for _, line in said), 300, "the wait")
        os.kill(holder.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        driver.wait(timeout=400)
        reader.join()
        lines = [line for _, line in said]
        assert driver.returncode == 0, "".join(lines)[-3000:]
        waiting = [line for line in lines if "waiting for driver" in line]
        assert len(waiting) == 1 and f"{holder.pid}@" in waiting[0], lines
        assert "holding the claim since" in waiting[0]
        freed = [at for at, line in said if "no sign of life" in line]
        assert len(freed) == 1 and freed[0] - stopped < STALE_S + 5, (freed, stopped)
        assert len(launched(tmp_path / "out")) == 1
        os.kill(holder.pid, signal.SIGCONT)
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "lost"
    finally:
        holder.kill()
        if driver is not None:
            driver.kill()


def recs_url(url: str) -> str:
    from autoshard.study.database import check_storage

    return check_storage(url)


# ---------------------------------------------------------------------------------------------
# Changed settings through the command line (issue 15, case 11)
# ---------------------------------------------------------------------------------------------


def test_changed_batch_sizes_start_a_new_study(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = tune("--batch-size", "1,2", "--trials", "2", "--out", str(out), "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    study_12 = json.loads(first.stdout)["study"]

    second = tune("--batch-size", "1", "--trials", "1", "--out", str(out), "--json")
    assert second.returncode == 0, second.stderr[-3000:]
    rec = json.loads(second.stdout)
    assert rec["study"] != study_12
    assert rec["chosen"]["candidate"]["micro_batch_size"] == 1  # never the excluded 2
    assert rec["chosen"]["estimate"] is not None  # predictions of its own study
    report = json.loads((out / "report.json").read_text())
    assert {t["candidate"]["micro_batch_size"] for t in report["trials"]} == {1}
    assert len(launched(out, rec["study"])) == 1 and len(launched(out, study_12)) == 2

    from autoshard.recommendation import load_result

    (out / "report.json").unlink()  # read back through recommendation.json + trials.jsonl
    _, trials = load_result(out)
    assert [t.candidate.micro_batch_size for t in trials if t.status.launched] == [1]

    again = tune("--batch-size", "1", "--trials", "1", "--out", str(out), "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["study"] == rec["study"]
    assert len(launched(out)) == 3  # resumed: nothing ran again


# ---------------------------------------------------------------------------------------------
# A changed model starts a new study (issue 25, case 1)
# ---------------------------------------------------------------------------------------------


def test_an_edited_model_file_is_measured_again(tmp_path: Path) -> None:
    """The same command on the same --out after the model file was made wider: no "resumed"
    trial, a new measurement, and one line saying that the model changed."""
    model = tmp_path / "model.py"
    source = (ROOT / "tests" / "targets" / "faults.py").read_text()
    model.write_text(source)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "autoshard", "tune", f"{model}:build", "--seq-len", "16",
               *QUICK, "--batch-size", "1", "--trials", "1", "--out", str(out), "--json"]  # fmt: skip

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400)

    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    model.write_text(source.replace("width: int = 32", "width: int = 64"))
    second = run()
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed" not in second.stderr, second.stderr
    notes = [line for line in second.stderr.splitlines() if "new study" in line]
    assert len(notes) == 1 and "the model (" in notes[0], second.stderr
    studies = [json.loads(r.stdout)["study"] for r in (first, second)]
    assert studies[0] != studies[1]
    trials = [read_records(out / "trials.jsonl", s) for s in studies]
    measured = [[r for r in t if r.status.launched] for t in trials]
    assert [len(m) for m in measured] == [1, 1]
    assert measured[1][0].started_at > measured[0][0].started_at
