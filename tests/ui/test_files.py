"""The report's files (autoshard/ui/files.py): written and read back, the YAML left out where it
cannot express the choice, and written atomically (a full disk leaves the last whole ones)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from autoshard.recommendation import load_result
from autoshard.ui.files import write_report
from autoshard.ui.report import SCHEMA
from tests.test_emit import all_trials, candidate, make_rec

FILES = {"report.json", "report.html", "lightning.yaml", "accelerate.yaml"}


def test_write_report_and_load_it_back(tmp_path: Path) -> None:
    rec = make_rec()
    trials = all_trials(rec)
    written = write_report(rec, tmp_path, trials)
    assert set(written) == FILES and all(p.stat().st_size > 0 for p in written.values())
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["schema"] == SCHEMA
    assert data["summary"]["label"] == rec.chosen.candidate.label()
    assert len(data["trials"]) == len(trials) == 5
    for source in (tmp_path, tmp_path / "report.json"):
        back, back_trials = load_result(source)
        assert back == rec and back_trials == trials


def test_yaml_left_out_when_it_cannot_express_the_choice(tmp_path: Path) -> None:
    from autoshard.config import BackwardPrefetch

    rec = make_rec(candidate(backward_prefetch=BackwardPrefetch.BACKWARD_POST))
    assert set(write_report(rec, tmp_path)) == FILES - {"lightning.yaml"}


def test_a_full_disk_while_writing_the_reports_leaves_the_last_whole_ones(tmp_path: Path) -> None:
    """Issue 25, case 9: reports are written atomically; a disk that fills while they are
    written again leaves the previous ones whole (export keeps working), and no stray file."""
    import os
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(disk)], capture_output=True
        ).returncode
        == 0
    )
    if not mounted:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        rec, trials = make_rec(), all_trials(make_rec())
        write_report(rec, disk, trials)
        before = (disk / "report.json").read_bytes()
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, os.urandom(4096))
        os.close(fd)
        with pytest.raises(OSError):
            write_report(rec, disk, trials)
        assert (disk / "report.json").read_bytes() == before
        assert load_result(disk / "report.json")[0] == rec
        assert sorted(p.name for p in disk.iterdir() if p.name.startswith(".")) == []
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
