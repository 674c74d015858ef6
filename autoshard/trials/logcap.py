"""A worker group's log, bounded per trial.

The workers' stdout and stderr reach the driver through a pipe; a thread copies them into the
group's log file. Each trial's output (a *section*: from its request to the next one) keeps its
first ``cap / 2`` bytes and its last ``cap / 2``: what lies between is replaced by one marker
line saying how much was left out. A model that prints megabytes per step then writes at most
``cap`` bytes per trial once the trial is over (up to ``cap / 2`` more while it runs, between
two compactions), and the file on disk is always the log as it stands, head and tail, even when
the driver is killed.

The tail is kept by compaction: output goes to the end of the file; once the part after the
head holds ``cap`` bytes, it is rewritten as the marker and its last ``cap / 2`` bytes; and
when the section ends (the next trial's request, the group's end), a tail longer than
``cap / 2`` is compacted too: a trial that printed between ``cap`` and ``1.5 cap`` bytes was
kept whole, without a marker.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import BinaryIO

from autoshard.config import DEFAULT_WORKER_LOG_CAP as DEFAULT_LOG_CAP

_CHUNK = 1 << 16


def marker(left_out: int, cap: int) -> bytes:
    return (
        f"\n[autoshard: {left_out} bytes of worker output left out here; the log keeps the "
        f"first and the last {cap // 2} bytes of each trial (--worker-log-cap)]\n"
    ).encode()


class CappedLog:
    """The log file of one worker group (see the module docstring). Thread-safe: the pump
    thread writes, the driver starts sections."""

    def __init__(self, path: Path, cap: int = DEFAULT_LOG_CAP) -> None:
        self.path = Path(path)
        self.cap = max(2, int(cap))
        self.half = self.cap // 2
        self.fh: BinaryIO = open(self.path, "wb+")  # noqa: SIM115 (closed by close())
        self._lock = threading.Lock()
        self._start = 0  # where the current section starts
        self._written = 0  # bytes of the section in the file after its start
        self._left_out = 0  # bytes of the section replaced by the marker
        self._tail_at = 0  # where the section's tail starts (after its head and marker)

    def write(self, data: bytes) -> None:
        with self._lock:
            if self.fh.closed:
                return
            self.fh.write(data)
            self.fh.flush()
            self._written += len(data)
            if self._tail_at == 0 and self._written > self.half:
                self._tail_at = self._start + self.half  # the head is full
            if self._tail_at and self.fh.tell() - self._tail_at > self.cap:
                self._compact()

    def new_section(self) -> None:
        """A new trial starts: its output is kept from its start."""
        with self._lock:
            if self.fh.closed:
                return
            self._finish()
            self._start = self.fh.tell()
            self._written = self._left_out = self._tail_at = 0

    def close(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            if not self.fh.closed:
                self._finish()
            self.fh.close()

    def _finish(self) -> None:
        """The section ends: its tail is cut to ``cap / 2`` bytes behind the marker."""
        kept = len(marker(self._left_out, self.cap)) if self._left_out else 0
        if self._tail_at and self.fh.tell() - self._tail_at > self.half + kept:
            self._compact()

    def _compact(self) -> None:
        end = self.fh.tell()
        self.fh.seek(end - self.half)
        keep = self.fh.read(self.half)
        old_marker = len(marker(self._left_out, self.cap)) if self._left_out else 0
        self._left_out += (end - self._tail_at) - old_marker - len(keep)
        self.fh.seek(self._tail_at)
        self.fh.write(marker(self._left_out, self.cap))
        self.fh.write(keep)
        self.fh.truncate()
        self.fh.flush()


def pump(fd: int, log: CappedLog) -> threading.Thread:
    """A daemon thread that copies what is read from ``fd`` (a pipe) into ``log`` until the
    pipe's writers are all gone, then closes both."""

    def copy() -> None:
        try:
            while True:
                data = os.read(fd, _CHUNK)
                if not data:
                    break
                log.write(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
            log.close()

    thread = threading.Thread(target=copy, daemon=True, name="autoshard-worker-log")
    thread.start()
    return thread


def read_tail(path: Path, size: int) -> bytes:
    """The last ``size`` bytes of ``path``, read by seeking from its end (b"": no file)."""
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, end - size))
            return fh.read(size)
    except OSError:
        return b""
