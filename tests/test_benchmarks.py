"""Every benchmark script starts: its imports resolve against today's package (a script whose
import broke when a name moved is found here, not by the next person who runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "results_file.py")


def test_the_benchmarks_folder_has_scripts() -> None:
    assert len(SCRIPTS) >= 10


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_starts(script: Path) -> None:
    # --help parses the arguments after the module's imports ran: nothing is measured
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
        cwd=BENCHMARKS.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
