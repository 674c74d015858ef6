"""``trials.jsonl``: the study's append-only record of truth.

Every result (a measured trial, a candidate pruned by its estimate or skipped because of a
failure) is appended here, flushed and fsync'd, *before* the optuna storage hears of it. So a
crash between the two, a database that is lost, emptied or corrupt, or a disk that fills up
never loses a finished trial: the storage is brought back in line from this file when the study
opens (:meth:`autoshard.study.storage.StudyStore.open_study`).

One JSON object per line: the :class:`~autoshard.results.TrialResult` with the name of the
study it belongs to (``"study"``), so that one output folder can hold several studies (changed
settings) and each report shows its own.

Two failure modes are handled here:
- a partial last line (the process died in the middle of a write) is cut off before anything is
  appended, with one line saying so;
- a full disk: a small reserve file is kept next to the journal; when an append finds no space,
  the reserve is given up so that the record fits, and the study stops with one line saying
  to free space and run the same command again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from autoshard.errors import AutoshardError, StorageError
from autoshard.results import TrialResult
from autoshard.ui.files import JOURNAL_FILE

JOURNAL_NAME = JOURNAL_FILE
RESERVE_NAME = ".autoshard-reserve"
# A trial's record is a few KiB (its step times and losses); this keeps room for many.
RESERVE_BYTES = 256 * 1024
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def record_line(study: str, result: TrialResult) -> bytes:
    """One journal line: ``{"study": ..., <the TrialResult's fields>}`` and a newline."""
    body = result.model_dump_json()
    return ('{"study":' + json.dumps(study) + "," + body[1:] + "\n").encode()


def read_records(
    path: Path | str,
    study: str | None = None,
    *,
    error: type[AutoshardError] = StorageError,
) -> list[TrialResult]:
    """The results recorded in ``path``, oldest first: those of ``study`` (lines of other
    studies, and lines written before records named their study, are left out), or every one
    when ``study`` is None. A partial last line (an interrupted write) is ignored; any other
    line that is not a record raises ``error``.

    >>> import tempfile
    >>> from autoshard import Candidate, TrialResult
    >>> path = Path(tempfile.mkdtemp()) / "trials.jsonl"
    >>> ok = TrialResult(candidate=Candidate(), status="ok")
    >>> _ = path.write_bytes(record_line("autoshard-a", ok) + record_line("autoshard-b", ok))
    >>> len(read_records(path)), len(read_records(path, "autoshard-a"))
    (2, 1)
    """
    p = Path(path)
    if not p.is_file():
        return []
    raw = p.read_bytes()
    lines = raw.split(b"\n")
    if lines and lines[-1]:
        lines = lines[:-1]  # no newline at the end: a write that did not complete
    out: list[TrialResult] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if not isinstance(data, dict):
                raise ValueError("not an object")
            name = data.pop("study", None)
            result = TrialResult.model_validate(data)
        except (ValueError, ValidationError):
            raise error(
                f"{p}:{n}: not a trial record; remove or fix that line (the file is "
                "append-only: every other line is a complete record)"
            ) from None
        if study is None or name == study:
            out.append(result)
    return out


class Journal:
    """Appends records to ``trials.jsonl`` durably (see the module docstring)."""

    def __init__(self, path: Path, notice: Callable[[str], None]) -> None:
        self.path = Path(path)
        self.reserve_path = self.path.with_name(RESERVE_NAME)
        self.notice = notice

    def repair(self) -> int:
        """Cut off a partial last line; returns the number of bytes removed (0: none)."""
        if not self.path.is_file():
            return 0
        with _storage_os_errors(self.path), open(self.path, "rb+") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return 0
            keep = _after_last_newline(fh, size)
            fh.truncate(keep)
            fh.flush()
            os.fsync(fh.fileno())
        self.notice(
            f"{self.path}: removed a partial last record ({size - keep} bytes, left by an "
            "interrupted write); the complete records before it are kept"
        )
        return size - keep

    def read(self, study: str | None = None) -> list[TrialResult]:
        return read_records(self.path, study)

    def studies(self) -> list[str]:
        """The names of the studies recorded here, in the order of their latest record."""
        if not self.path.is_file():
            return []
        order: dict[str, None] = {}
        with _storage_os_errors(self.path), open(self.path, "rb") as fh:
            for line in fh:
                try:
                    name = json.loads(line).get("study")
                except (ValueError, AttributeError):
                    continue  # a partial or foreign line: read_records says so where it matters
                if isinstance(name, str):
                    order.pop(name, None)
                    order[name] = None
        return list(order)

    def keep_reserve(self) -> None:
        """Make sure the reserve exists (a fresh study, or the space was freed since)."""
        if self.reserve_path.exists():
            return
        try:
            fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                # Random bytes: a compressing file system would store zeros in no space.
                _write_all(fd, os.urandom(RESERVE_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.reserve_path.unlink()
            if exc.errno in _NO_SPACE:
                raise StorageError(
                    f"{self.path.parent}: no space left on the device; free some space, then run "
                    "the same command again"
                ) from None
            raise StorageError(
                f"{self.path.parent}: cannot write there ({exc.strerror or exc}); choose a "
                "writable folder with --out"
            ) from None

    def append(self, study: str, result: TrialResult) -> None:
        """Append one record and fsync it; a full disk gives up the reserve for it, then stops
        the study (StorageError) once the record is safe."""
        line = record_line(study, result)
        try:
            self._append(line)
            return
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise StorageError(
                    f"{self.path}: cannot record the trial of {result.candidate.label()} "
                    f"({exc.strerror or exc}); make the output folder writable, then run the same "
                    "command again"
                ) from None
        released = self._release_reserve()
        try:
            if not released:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._append(line)
        except OSError as exc:
            raise StorageError(
                f"{self.path}: no space left to record the trial of {result.candidate.label()} "
                f"({result.status.value}) ({exc.strerror or exc}); free some space, then run the "
                "same command again (that trial runs again)"
            ) from None
        raise StorageError(
            f"no space left on the device of {self.path.parent}: the last trial "
            f"({result.candidate.label()}, {result.status.value}) was recorded in {self.path.name} "
            "in the space autoshard kept in reserve; free some space, then run the same command "
            "again to resume"
        )

    def _append(self, line: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            try:
                _write_all(fd, line)
                os.fsync(fd)
            except OSError:
                # Take back what was written of this line, so that the next attempt (after
                # freeing space) does not leave half a record in front of it.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)

    def _release_reserve(self) -> bool:
        try:
            self.reserve_path.unlink()
        except FileNotFoundError:
            return False
        return True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _after_last_newline(fh: BinaryIO, size: int) -> int:
    """The offset just after the last newline of an open binary file (0: there is none)."""
    block = 64 * 1024
    end = size
    while end > 0:
        start = max(0, end - block)
        fh.seek(start)
        chunk = fh.read(end - start)
        at = chunk.rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


@contextlib.contextmanager
def _storage_os_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise StorageError(
            f"{path}: cannot read or repair it ({exc.strerror or exc}); make it writable or "
            "choose another --out"
        ) from None
