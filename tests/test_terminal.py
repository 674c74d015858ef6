"""What ``autoshard estimate`` and ``autoshard tune`` print fits a terminal of 80 or 100 columns
without cutting a header, a value or a reason mid-word: every word printed at that width is a
word of the same output at 1000 columns, no line is wider than the terminal, and rich's ellipsis
never appears."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.cells import cell_len

from autoshard.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["examples/gpt.py:build", "--arg", "size=tiny"]
# Box drawing and the bullet separate words as spaces do.
SEPARATORS = re.compile(r"[\s\u2500-\u257f\u2022]+")


def _run(args: list[str], columns: int) -> str:
    env = child_env(ROOT, COLUMNS=str(columns))
    env.pop("FORCE_COLOR", None)
    done = subprocess.run(
        [sys.executable, "-m", "autoshard", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def _words(text: str) -> set[str]:
    return {w for w in SEPARATORS.split(text) if w}


def assert_fits(narrow: str, wide: str, columns: int, headers: list[str]) -> None:
    lines = narrow.splitlines()
    too_wide = [line for line in lines if cell_len(line.rstrip()) > columns]
    assert not too_wide, f"wider than {columns} columns:\n" + "\n".join(too_wide)
    assert "\u2026" not in narrow, "rich cut something with an ellipsis"
    cut = sorted(_words(narrow) - _words(wide))
    assert not cut, f"words cut at {columns} columns: {cut}"
    for header in headers:
        assert all(word in _words(narrow) for word in header.split()), header


@pytest.mark.slow
def test_estimate_fits_the_terminal_and_ends_with_the_decision() -> None:
    args = ["estimate", *TINY, "--gpus", "8", "--gpu-memory", "24GiB", "--seq-len", "128"]
    every = _run([*args, "--all"], 1000)
    assert every.split("Per-GPU memory")[1].count("\u2502 fsdp") > 20
    wide = _run(args, 1000)
    for columns in (80, 100):
        narrow = _run(args, columns)
        headers = ["configuration", "fits", "GPU peak", "tokens/s per GPU"]
        assert_fits(narrow, wide, columns, headers)
        # The first 20 candidates, the recommended one marked; then the decision and why.
        table = narrow.split("Per-GPU memory")[1].split("Breakdown")[0]
        assert table.count("\u2502 fsdp") == 20
        words = " ".join(SEPARATORS.split(table))
        assert "--all shows them" in words
        assert "\u2190 recommended" in table
        decision = narrow.split("autoshard recommends ")[1]
        assert decision.startswith("fsdp1") and "Why" in decision and "sharding" in decision


@pytest.mark.slow
def test_tune_fits_the_terminal(tmp_path: Path) -> None:
    """One short study, printed at 80 columns; the same study resumed (nothing rerun) at 100
    and at 1000 columns."""
    out = tmp_path / "out"
    args = ["tune", *TINY, "--seq-len", "64", "--batch-size", "1", "--gpu-memory", "2GiB",
            "--trials", "2", "--warmup", "1", "--steps", "2", "--out", str(out)]  # fmt: skip
    at80 = _run(args, 80)
    wide = _run(args, 1000)
    at100 = _run(args, 100)
    headers = ["configuration", "measured peak", "why not", "Why"]
    for columns, narrow in ((80, at80), (100, at100)):
        assert_fits(narrow, wide + at80, columns, headers)
    # The reasons are whole: the skipped offload candidates' one, word for word.
    reason = "CPU workers cannot try it"
    assert reason in " ".join(SEPARATORS.split(wide))
    for narrow in (at80, at100):
        assert reason in " ".join(SEPARATORS.split(narrow))
