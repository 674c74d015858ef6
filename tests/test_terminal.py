"""What ``autoshard estimate`` and ``autoshard tune`` print fits a terminal of 80 or 100 columns
without cutting a header, a value or a reason mid-word: every word printed at that width is a
word of the same output at 1000 columns, no line is wider than the terminal, and rich's ellipsis
never appears."""

from __future__ import annotations

import os
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
    # both trials measured: no row needs a "why not" column (candidates never launched are a
    # line per reason after the table, checked below)
    headers = ["configuration", "measured peak", "Why"]
    for columns, narrow in ((80, at80), (100, at100)):
        assert_fits(narrow, wide + at80, columns, headers)
    # The reasons are whole: the skipped offload candidates' one, word for word.
    reason = "CPU workers cannot try it"
    assert reason in " ".join(SEPARATORS.split(wide))
    for narrow in (at80, at100):
        assert reason in " ".join(SEPARATORS.split(narrow))


# ---------------------------------------------------------------------------------------------
# The live view in a real pseudo-terminal
# ---------------------------------------------------------------------------------------------


class Screen:
    """The visible cells of a terminal of ``rows`` x ``cols`` fed what a program writes: the
    control sequences rich's live display uses (carriage return, line feed with scrolling,
    cursor moves, erasing lines and the display); colours and modes are ignored."""

    CSI = re.compile(r"\x1b\[([0-9;?]*)([@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][A-Z0-9]")

    def __init__(self, rows: int, cols: int) -> None:
        self.rows, self.cols = rows, cols
        self.cells = [[" "] * cols for _ in range(rows)]
        self.r = self.c = 0
        self.pending = ""  # an escape sequence cut by the end of a read, until it is whole

    def lines(self) -> list[str]:
        return ["".join(row).rstrip() for row in self.cells]

    def _newline(self) -> None:
        self.r += 1
        if self.r == self.rows:  # scrolled: the top line is gone from the screen
            self.cells = [*self.cells[1:], [" "] * self.cols]
            self.r = self.rows - 1

    def feed(self, text: str) -> None:
        text, self.pending = self.pending + text, ""
        cut = text.rfind("\x1b")
        if cut >= 0 and not self.CSI.match(text, cut):
            text, self.pending = text[:cut], text[cut:]
        pos = 0
        for match in self.CSI.finditer(text):
            self._chars(text[pos : match.start()])
            pos = match.end()
            if match.group(2):
                self._control(match.group(1), match.group(2))
        self._chars(text[pos:])

    def _chars(self, text: str) -> None:
        for ch in text:
            if ch == "\r":
                self.c = 0
            elif ch == "\n":
                self._newline()
            elif ch == "\b":
                self.c = max(self.c - 1, 0)
            elif ch >= " " and ch != "\x7f":
                if self.c == self.cols:  # autowrap
                    self.c = 0
                    self._newline()
                self.cells[self.r][self.c] = ch
                self.c += 1

    def _control(self, params: str, final: str) -> None:
        numbers = [int(p) for p in params.lstrip("?").split(";") if p.isdigit()]
        n = numbers[0] if numbers else None
        if final == "A":
            self.r = max(self.r - (n or 1), 0)
        elif final == "B":
            self.r = min(self.r + (n or 1), self.rows - 1)
        elif final == "C":
            self.c = min(self.c + (n or 1), self.cols - 1)
        elif final == "D":
            self.c = max(self.c - (n or 1), 0)
        elif final == "G":
            self.c = min((n or 1) - 1, self.cols - 1)
        elif final in "Hf":
            row, col = (numbers[0], numbers[1]) if len(numbers) >= 2 else (n or 1, 1)
            self.r, self.c = min(row - 1, self.rows - 1), min(col - 1, self.cols - 1)
        elif final == "K":
            row = self.cells[self.r]
            start, end = {0: (self.c, self.cols), 1: (0, self.c + 1), 2: (0, self.cols)}[n or 0]
            row[start:end] = [" "] * (end - start)
        elif final == "J" and (n or 0) == 2:
            self.cells = [[" "] * self.cols for _ in range(self.rows)]


def test_the_screen_emulator_does_what_a_terminal_does() -> None:
    screen = Screen(3, 10)
    screen.feed("one\r\ntwo\r\nthree\r\nfour")  # four lines on three rows: one scrolled off
    assert screen.lines() == ["two", "three", "four"]
    screen.feed("\r\x1b[2K\x1b[1A\x1b[2Kxy\x1b[1mz\x1b[0m")  # rich's live redraw, a colour
    assert screen.lines() == ["two", "xyz", ""]
    screen.feed("\r\n0123456789ab")  # past the last column: wraps, and scrolls
    assert screen.lines() == ["xyz", "0123456789", "ab"]
    screen.feed("\x1b[1")  # a sequence cut between two reads
    screen.feed("AZ")
    assert screen.lines() == ["xyz", "01Z3456789", "ab"]


@pytest.mark.slow
def test_tune_in_an_80x24_terminal_keeps_the_running_trial_and_the_best_on_screen(
    tmp_path: Path,
) -> None:
    """``autoshard tune`` in a pseudo-terminal of 80 x 24 (its size set on the terminal, as a
    user's window sets it): while a trial runs, its line is on screen, with the best so far,
    although the skipped offload candidates (the CPU workers cannot run them) outnumber the
    rows; they are one line per reason, not one row each."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    kept = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}
    env = child_env(ROOT, base=kept, TERM="xterm-256color")
    args = ["tune", *TINY, "--seq-len", "64", "--batch-size", "1,2", "--gpu-memory", "2GiB",
            "--no-compile", "--trials", "3", "--warmup", "1", "--steps", "3",
            "--out", str(tmp_path / "out")]  # fmt: skip
    tune = subprocess.Popen(
        [sys.executable, "-m", "autoshard", *args],
        cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
    )  # fmt: skip
    os.close(slave)
    screen, seen = Screen(24, 80), []
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the program ended: the terminal is closed
                    break
                if not chunk:
                    break
                screen.feed(chunk.decode("utf-8", "replace"))
                lines = screen.lines()
                running = [line for line in lines if line.startswith("running: fsdp")]
                if running and any(line.startswith("★ best so far") for line in lines):
                    seen.append(lines)
            elif tune.poll() is not None:
                break
    finally:
        if tune.poll() is None:
            tune.kill()  # this test's own process, by its handle
        tune.wait(timeout=60)
        os.close(master)
    assert tune.returncode == 0
    assert seen, "never saw a running trial and the best so far on the 80 x 24 screen"
    shown = seen[-1]
    assert len(shown) == 24 and all(len(line) <= 80 for line in shown)
    # one line for the skipped offload candidates, however many: never a row each
    skipped = [line for line in shown if " skipped, never launched: " in line]
    assert len(skipped) == 1 and int(skipped[0].split()[0]) > 4, shown
    assert sum("offload" in line for line in shown) <= 1, shown
