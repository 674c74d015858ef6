"""The --out folder's lock (study/lock.py): what it names of the command that holds it, with a
storage URL's password masked, readable by its owner only. Moved from tests/test_secrets.py."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from autoshard.study.lock import LOCK_NAME, OutLock, masked

PASSWORD = "S3cret-Pa55word"


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
