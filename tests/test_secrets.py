"""Nothing secret on disk, nothing shared trusted (issue 36): no file under --out holds the
storage URL's password (during the run, as a kill -9 would leave them, and after); a model
object is saved in a folder of this user's own, never a predictable shared path, and nothing is
unpickled from a path another user could write."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoshard.study.lock import LOCK_NAME

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
