"""Nothing secret on disk, nothing shared trusted (issue 36): no file under --out holds the
storage URL's password (during the run, as a kill -9 would leave them, and after); a model
object is saved in a folder of this user's own, never a predictable shared path, and nothing is
unpickled from a path another user could write."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from autoshard.errors import TargetError
from autoshard.study.lock import LOCK_NAME, OutLock, masked
from autoshard.target import adapters
from autoshard.target.adapters import load_saved_model, to_target

from .conftest import ROOT
from .postgres import binaries, postgres_instance

PASSWORD = "S3cret-Pa55word"


def files_holding(folder: Path, secret: str) -> list[str]:
    """Every file under ``folder`` whose bytes hold ``secret``."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if secret.encode() in path.read_bytes():
                    found.append(str(path.relative_to(folder)))
            except OSError:
                continue
    return found


def test_the_lock_names_the_command_with_its_password_masked(tmp_path: Path, monkeypatch) -> None:
    argv = ["autoshard", "tune", "m.py:build", "--storage",
            f"postgresql://me:{PASSWORD}@db:5432/x", f"--storage=mysql://a:{PASSWORD}@h/y"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    with OutLock(tmp_path):
        text = (tmp_path / LOCK_NAME).read_text()
        mode = stat.S_IMODE(os.stat(tmp_path / LOCK_NAME).st_mode)
    assert PASSWORD not in text and "postgresql://me:***@db:5432/x" in text, text
    assert mode == 0o600, oct(mode)
    assert masked("sqlite:////a/b.db --arg x=1") == "sqlite:////a/b.db --arg x=1"


@pytest.mark.slow
def test_no_file_of_a_tune_holds_the_storage_password(tmp_path: Path) -> None:
    """A real PostgreSQL (trust auth: any password is accepted, as a real one would check it):
    every file under --out while the first trial runs (what a kill -9 leaves) and after the end."""
    pytest.importorskip("psycopg")
    if binaries() is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl) on this machine")
    out = tmp_path / "out"
    with postgres_instance() as server:
        url = server.url.replace("autoshard@", f"autoshard:{PASSWORD}@")
        command = [sys.executable, "-m", "autoshard", "tune", "tests/targets/faults.py:build",
                   "--seq-len", "16", "--gpu-memory", "4GiB", "--precision", "32-true",
                   "--batch-size", "1", "--trials", "1", "--warmup", "1", "--steps", "2",
                   "--arg", "fault=slow", "--arg", "seconds=3", "--storage", url,
                   "--out", str(out)]  # fmt: skip
        driver = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 300
        while not any(out.glob("workers/group-*/request-0.json")):
            assert driver.poll() is None, driver.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no trial started"
            time.sleep(0.2)
        during = files_holding(out, PASSWORD)
        assert PASSWORD not in (out / LOCK_NAME).read_text()
        assert "***" in (out / LOCK_NAME).read_text()  # the command is there, masked
        _, stderr = driver.communicate(timeout=600)
    assert driver.returncode == 0, stderr[-3000:]
    assert during == [], during
    assert files_holding(out, PASSWORD) == []
    assert PASSWORD not in stderr


# --------------------------------------------------------------------------------------------
# A model object: saved in a private folder, loaded from nowhere else
# --------------------------------------------------------------------------------------------


class Planted:
    """What a hostile pickle runs when it is loaded: it writes a file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path(self.marker).write_text, ("unpickled",))


def test_a_planted_symlink_in_the_old_shared_folder_is_not_followed(tmp_path, monkeypatch):
    """Another user creates $TMPDIR/autoshard-targets first and plants, at the name the model
    would get, a symlink to a victim file and a pickle that runs code: to_target writes neither,
    and the victim is untouched."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    planted = shared / "autoshard-targets"
    planted.mkdir(mode=0o777)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    model = nn.Sequential(nn.Linear(4, 4))
    name = f"model-{adapters._digest_module(model)}.pt"
    (planted / name).symlink_to(victim)
    spec = to_target(model)
    path = Path(spec.kwargs["path"])
    assert victim.read_text() == "precious"
    assert planted not in path.parents, path
    folder = path.parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = load_saved_model(str(path))
    assert isinstance(loaded, nn.Sequential)


def test_nothing_is_unpickled_from_a_path_another_user_can_write(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # a folder anyone can write, like /tmp
    bad = shared / "model.pt"
    torch.save({"model": Planted(str(marker)), "batch": None}, bad)
    with pytest.raises(TargetError, match="not a private folder"):
        load_saved_model(str(bad))
    assert not marker.exists()
    # a symlink to it from a private folder is no way around it
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "model.pt").symlink_to(bad)
    with pytest.raises(TargetError):
        load_saved_model(str(private / "model.pt"))
    assert not marker.exists()


def test_a_saved_batch_is_read_without_unpickling_code(tmp_path: Path) -> None:
    """A batch holds tensors: it is read with weights_only=True even from autoshard's folder."""
    marker = tmp_path / "ran"
    spec = to_target("tests/targets/faults.py:build", batch=torch.zeros(2, 16, dtype=torch.long),
                     out_dir=tmp_path / "out")  # fmt: skip
    batch_path = Path(spec.kwargs["batch_path"])
    torch.save(Planted(str(marker)), batch_path)  # replaced by a hostile pickle
    with pytest.raises(TargetError):
        adapters.with_saved_batch(**spec.kwargs)
    assert not marker.exists()
