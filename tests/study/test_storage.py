"""The study's storage (autoshard/study/storage.py): the journal as the record of truth and a lost
database rebuilt from it, storage errors as one line each (a full disk, a bad URL, read-only
folders and files), and a driver that is gone. Trials are a function here (tests/test_study.py's
Runner)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoshard.config import Candidate
from autoshard.errors import StorageError
from autoshard.results import TrialResult
from autoshard.study import journal as journal_mod
from autoshard.study.loop import run_trials
from autoshard.study.storage import open_store

from ..test_study import TARGET, Runner, estimates, journal, settings, space, study


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
    root = Path(__file__).resolve().parents[2]
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
