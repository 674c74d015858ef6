"""benchmarks/gpu.sh: every GPU measurement in one lease of the lent machine, one archive. The
GPU run itself needs a GPU; its CPU dry run (2 gloo processes, tiny shapes, the same parts, code
paths and archive) runs here, so the script cannot rot unseen between GPU runs (it did: the
first GPU run found it broken four ways, ../shared/gpu-runs/2026-11-28-h200/README.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_SH = ROOT / "benchmarks" / "gpu.sh"
# What one device call allows (the run tool): a command of at most 600 s and 2,000 characters.
CALL_SECONDS, COMMAND_CHARS = 600, 2000


def budget(table: str = "BUDGET") -> dict[str, int]:
    """gpu.sh's budget table: part -> seconds."""
    text = GPU_SH.read_text()
    block = re.search(rf'^{table}="\n(.*?)^"', text, re.S | re.M)
    assert block, table
    return {line.split()[0]: int(line.split()[1]) for line in block.group(1).splitlines() if line}


def test_the_budget_fits_one_device_call_and_names_every_part() -> None:
    parts = budget()
    assert list(parts)[:2] == ["tune7b", "gpu-tests"]  # the most valuable first
    assert {"memory-grid", "accuracy", "handover", "speed-grid", "compile-float8"} <= set(parts)
    deadline = int(re.search(r"AUTOSHARD_GPU_SECONDS:-(\d+)", GPU_SH.read_text()).group(1))
    # the parts, then the wheels' install (~20 s), the checks and the packing, in one call
    assert sum(parts.values()) <= deadline - 15 and deadline <= CALL_SECONDS - 30
    text = GPU_SH.read_text()
    for part in [*parts, *budget("EXTRA")]:
        assert re.search(rf"^\s+{part}\) ", text, re.M), f"no command for {part}"


def test_the_device_command_is_documented_and_fits_the_tool() -> None:
    readme = (ROOT / "README.md").read_text()
    command = 'bash benchmarks/gpu.sh all "$OUT"'
    assert command in readme and command in GPU_SH.read_text()
    assert len(command) < COMMAND_CHARS


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "usage: bash benchmarks/gpu.sh all|PART OUT"),
        (["speed", "/tmp/x"], "unknown part 'speed'"),
        (["all", "/tmp/x", "--fast"], "unknown option --fast"),
    ],
)
def test_a_wrong_call_says_what_is_wrong_in_one_line(args: list[str], says: str) -> None:
    done = subprocess.run(["bash", str(GPU_SH), *args], capture_output=True, text=True)
    assert done.returncode == 1
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 671 s (195 s of CPU) at load 17-19 on 2 cores
def test_the_dry_run_runs_every_part_and_packs_one_archive(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", str(GPU_SH), "all", str(tmp_path / "out"), "--dry-run"],
        capture_output=True, text=True, timeout=1150, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    (archive,) = (tmp_path / "out").iterdir()
    assert archive.name == "autoshard-gpu.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    got = tmp_path / "x" / "autoshard-gpu"
    # the command and the versions, the budget, what each part used
    assert "bash benchmarks/gpu.sh all" in (got / "command.txt").read_text()
    assert "torch" in (got / "versions.txt").read_text()
    assert "every need imports" in (got / "wheels.txt").read_text()
    rows = [line.split() for line in (got / "parts.txt").read_text().splitlines()[1:]]
    assert [row[0] for row in rows] == list(budget())
    assert all(row[3] == "0" for row in rows), rows
    # each part's results, written as they came
    one = json.loads((got / "grid_one_group.json").read_text())
    fresh = json.loads((got / "grid_fresh_groups.json").read_text())
    assert (one["header"]["fresh_group"], fresh["header"]["fresh_group"]) == (False, True)
    assert [r["label"] for r in one["rows"]] == [r["label"] for r in fresh["rows"]]
    assert all(r["trial"]["status"] == "ok" for r in one["rows"] + fresh["rows"])
    assert "one group, GiB" in (got / "groups_compare.md").read_text()
    (measured,) = (got / "accuracy").glob("estimate_accuracy_measured_cpu*.json")
    assert all("tracked" in m for m in json.loads(measured.read_text()))
    assert json.loads((got / "compile_float8.json").read_text())["rows"]
    assert (got / "tune" / "trials.jsonl").read_text().strip()
    # the launchers' children kept the parent's PYTHONPATH (the probe on it logged them)
    children = (got / "children.log").read_text()
    assert "-m autoshard.trials.worker" in children
    assert "estimate_accuracy.py --worker" in children
