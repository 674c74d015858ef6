"""One ``autoshard tune`` per output folder.

Two runs on one ``--out`` would both append to its ``trials.jsonl`` and, with the default SQLite
storage, each would take the other's running trial for one left by a killed process. The first
run holds an exclusive ``fcntl.flock`` on ``--out/autoshard.lock`` (which holds its PID, host and
command, any URL's password masked: :func:`masked`; mode 0600) for as long as it runs; a second
one refuses in one line naming that PID, or with ``wait=True`` waits for it. The kernel drops
the lock when its holder dies, however it dies (``kill -9`` included), so a stale lock file is
simply taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autoshard.errors import StorageError, StudyLockedError

try:  # POSIX; elsewhere the folder is not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = "autoshard.lock"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


class OutLock:
    """The exclusive lock of one output folder (use as a context manager).

    >>> import tempfile
    >>> from autoshard.errors import StudyLockedError
    >>> folder = Path(tempfile.mkdtemp())
    >>> with OutLock(folder):
    ...     try:
    ...         OutLock(folder).acquire()
    ...     except StudyLockedError as error:
    ...         print(error.pid == os.getpid(), "--out" in str(error))
    True True
    """

    def __init__(
        self, folder: Path | str, *, wait: bool = False, notice: Callable[[str], None] = print
    ) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.wait = wait
        self.notice = notice
        self.fd: int | None = None

    def __enter__(self) -> OutLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise StorageError(
                f"--out {self.folder}: cannot write there ({exc.strerror or exc}); choose a "
                "writable folder with --out"
            ) from None
        try:
            os.fchmod(fd, 0o600)  # one written by an older autoshard was 0644
            self._lock(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_me()).encode() + b"\n", 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)  # a holder that has ended names no PID
        os.close(self.fd)  # closing the descriptor releases the flock
        self.fd = None

    def holder(self) -> dict[str, Any]:
        """What the lock file says about its holder ({} when unreadable)."""
        try:
            data = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _lock(self, fd: int) -> None:
        if fcntl is None:  # pragma: no cover
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError:
            # A file system without flock (some network mounts): trust the PID in the file.
            held = self.holder()
            if held.get("host") == socket.gethostname() and pid_alive(int(held.get("pid", 0))):
                raise self._locked(held) from None
            return
        held = self.holder()
        if not self.wait:
            raise self._locked(held)
        self.notice(f"{self._describe(held)} holds {self.folder}: waiting for it to end")
        started = time.monotonic()
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.notice(f"{self.folder} is free after {time.monotonic() - started:.0f} s: starting")

    def _locked(self, held: dict[str, Any]) -> StudyLockedError:
        pid = held.get("pid")
        return StudyLockedError(
            f"--out {self.folder} is in use by {self._describe(held)} ({self.path}); wait for "
            "it to end, add --wait to start when it does, or choose another --out",
            pid=int(pid) if isinstance(pid, int) else None,
        )

    @staticmethod
    def _describe(held: dict[str, Any]) -> str:
        pid, host = held.get("pid"), held.get("host")
        if pid is None:
            return "another autoshard tune (PID unknown)"
        where = f" on {host}" if host else ""
        text = f"autoshard tune PID {pid}{where}"
        if host == socket.gethostname() and not pid_alive(int(pid)):
            text += " (no longer running; a process it started still holds the lock)"
        return text


def _me() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": masked(" ".join(sys.argv))[:500],
    }


# scheme://user:password@ (the password: anything up to the last @ before the host)
_URL_PASSWORD = re.compile(r"(\b[A-Za-z][\w+.-]*://[^\s:/@]*):[^\s/]*@")


def masked(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``, as SQLAlchemy shows
    a URL (``--storage postgresql://user:***@host/db``): what autoshard writes to disk.

    >>> masked("tune m.py:build --storage postgresql://me:s3cr@t@db:5432/x --out o")
    'tune m.py:build --storage postgresql://me:***@db:5432/x --out o'
    """
    return _URL_PASSWORD.sub(r"\1:***@", text)
