"""Reading a worker log: why a worker group ended (torchrun's summary of the first rank that
failed: its exit code or signal) and the most telling line of what the workers wrote, without
Python's warnings and without the echoes of another rank's death."""

from __future__ import annotations

import re
import signal

# "/path/x.py:12: FutureWarning: ..." (and the indented source line Python prints after it)
_WARNING = re.compile(r"\b[A-Z]\w*Warning\b:")
# an exception line: "ValueError: boom", "torch.OutOfMemoryError: ...", "[rank1]: KeyError: 'x'"
_EXCEPTION = re.compile(
    r"^(\[rank\d+\]:\s*)?([A-Za-z_][\w.]*)?(Error|Exception|Exit|Interrupt)(:|$)"
)
_TORCHRUN_WRAPPER = "ChildFailedError"
_SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\) received")
_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
# torchrun's own death by a signal it handles (SIGTERM, SIGINT, SIGHUP): it stops its workers
LAUNCHER_SIGNAL = re.compile(r"SignalException: Process \d+ got signal: (\d+)")
# What a rank says when another one died: never the cause of a failure, only its echo.
_ECHO = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|remote process exited|"
    r"NCCL communicator was aborted",
    re.IGNORECASE,
)


class CrashCause:
    """What torchrun's summary says about the first rank that failed."""

    def __init__(self, rank: int | None, exitcode: int | None, signal: int | None) -> None:
        self.rank, self.exitcode, self.signal = rank, exitcode, signal

    def __repr__(self) -> str:
        return f"CrashCause(rank={self.rank}, exitcode={self.exitcode}, signal={self.signal})"


def crash_cause(log: str) -> CrashCause:
    """The rank, exit code and signal of torchrun's "Root Cause (first observed failure)"."""
    root = log.rsplit("Root Cause", 1)[1] if "Root Cause" in log else log
    rank = _ROOT_RANK.search(root)
    codes = _EXITCODE.findall(root)
    exitcode = int(codes[0] if "Root Cause" in log else codes[-1]) if codes else None
    found = _SIGNAL.search(root)
    sig = int(found.group(1)) if found else (-exitcode if exitcode and exitcode < 0 else None)
    return CrashCause(int(rank.group(1)) if rank else None, exitcode, sig)


def signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} (signal {number})"
    except ValueError:
        return f"signal {number}"


def _without_warnings(log: str) -> list[str]:
    """The log's lines, without Python's warnings (a warning line and the indented source line
    printed after it), which are no error however alarming their text."""
    kept: list[str] = []
    skip_source = False
    for raw in log.splitlines():
        if _WARNING.search(raw):
            skip_source = True
            continue
        if skip_source and raw.startswith((" ", "\t")):
            skip_source = False  # the warning's source line
            continue
        skip_source = False
        if raw.strip():
            kept.append(raw.strip())
    return kept


def last_error_line(log: str, *, fallback: bool = True) -> str:
    """The most telling line of a worker log: the last exception a worker raised; else, with
    ``fallback``, the signal or exit code torchrun reports, else the last line that is not a
    warning; else ""."""
    lines = [line for line in _without_warnings(log) if len(line) < 500]
    for line in reversed(lines):
        if _EXCEPTION.match(line) and _TORCHRUN_WRAPPER not in line and not _ECHO.search(line):
            return line
    if not fallback:
        return ""
    for line in reversed(lines):
        if _SIGNAL.search(line) or _EXITCODE.search(line):
            return line
    return lines[-1][:300] if lines else ""
