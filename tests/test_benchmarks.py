"""Every benchmark script starts: its imports resolve against today's package (a script whose
import broke when a name moved is found here, not by the next person who runs it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(
    p
    for p in BENCHMARKS.glob("*.py")
    if p.name not in ("results_file.py", "trial_runs.py", "golden.py")
)  # their helpers have no command line


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


def _gpu_sh_commands() -> list[tuple[str, set[str]]]:
    """(script, the --flags gpu.sh passes it) of every benchmark gpu.sh runs."""
    text = (BENCHMARKS / "gpu.sh").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        match = re.search(r"python3 (benchmarks/\w+\.py)(.*)", line)
        if match:
            commands.append((match.group(1), set(re.findall(r"(--[\w-]+)", match.group(2)))))
    return commands


def test_gpu_sh_runs_benchmarks_with_flags_they_take() -> None:
    # gpu.sh runs only on a lent GPU machine, where a flag a script no longer takes would cost
    # device time: each flag it passes must be one the script's --help lists
    commands = _gpu_sh_commands()
    assert {script for script, _ in commands} >= {
        "benchmarks/estimate_accuracy.py",
        "benchmarks/tune_overhead.py",
        "benchmarks/step_time_measured.py",
    }
    for script, flags in commands:
        done = subprocess.run(
            [sys.executable, script, "--help"], capture_output=True, text=True, timeout=120,
            cwd=BENCHMARKS.parent,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        taken = set(re.findall(r"(--[\w-]+)", done.stdout))
        assert flags <= taken, f"{script}: gpu.sh passes {sorted(flags - taken)}"
