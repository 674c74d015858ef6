"""The claim lock of a study's storage, and riding out a database that goes away for a while.

Every driver of a storage looks at the study and claims its next candidate under one lock
(:mod:`autoshard.study.storage`), held for the milliseconds of a turn. That lock must never
wedge a study:

- SQLite: an ``flock`` next to the file; the kernel releases it when its holder dies, and a
  stopped holder on this machine is the user's own (Ctrl-Z).
- PostgreSQL: ``pg_try_advisory_lock``, tried again with back-off, never a blocking
  ``pg_advisory_lock``. The holder names itself in its session's ``application_name``
  (``autoshard PID@host since HH:MM:SS``) and beats on the lock's connection every
  :data:`BEAT_S` seconds while it holds it. A driver that waits more than
  :data:`WAIT_NOTICE_S` says so in one line ("waiting for driver PID@host, holding the claim
  since ..."); a holder whose connection has been silent for :data:`STALE_S` (stopped by
  SIGSTOP or Ctrl-Z, a paused VM, a half-open connection) is taken for dead: its session is ended
  (``pg_terminate_backend``), which releases the lock, with one line. A live holder is waited
  for up to :data:`LOCK_TIMEOUT_S`, then the study stops in one line. A holder that comes back
  finds its session gone before it claims anything (:meth:`ClaimLock.check`), and takes its turn
  again.
- MySQL: ``GET_LOCK`` with a timeout of :data:`LOCK_TIMEOUT_S`.

A server restart or a failover: every storage operation that fails because the connection was
lost is tried again with back-off for up to :data:`RECONNECT_S` seconds (one line when it
starts), then the study stops in one line. Nothing measured is lost either way: results go to
``trials.jsonl`` first (:mod:`autoshard.study.journal`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy
from sqlalchemy.engine import make_url

from autoshard.errors import StorageError
from autoshard.study.lock import pid_alive
from autoshard.study.view import ClaimLost

if TYPE_CHECKING:  # optuna is imported where a study runs
    import optuna
    from optuna.storages import RDBStorage

OWNER_ATTR = "autoshard_driver"  # a running trial's driver: host, PID, output folder, token

try:
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

T = TypeVar("T")

LOCK_KEY = 0x6175_746F_7368_6172  # "autoshar": the advisory lock of autoshard's claims
BEAT_S = 2.0  # how often a holder shows it is alive on the lock's connection
STALE_S = 15.0  # a holder silent this long is stopped or cut off (a turn takes milliseconds)
WAIT_NOTICE_S = 5.0  # a wait longer than this is said
LOCK_TIMEOUT_S = 300.0  # the longest wait for a live holder
RECONNECT_S = 120.0  # how long a lost database connection is tried again
_POLL_S = (0.05, 1.0)  # the back-off of a try for the lock: first and longest pause


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a lost or refused database connection."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, sqlalchemy.exc.DBAPIError) and cause.connection_invalidated:
            return True
        if isinstance(cause, sqlalchemy.exc.OperationalError | sqlalchemy.exc.InterfaceError):
            return True
        if type(cause).__name__ in ("OperationalError", "InterfaceError") and "psycopg" in (
            type(cause).__module__
        ):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class Reconnecting:
    """Runs storage operations, trying again with back-off while the connection is lost (not for
    SQLite: a local file's errors do not pass by waiting)."""

    def __init__(self, shown: str, backend: str, notice: Callable[[str], None]) -> None:
        self.shown, self.notice = shown, notice
        self.enabled = backend != "sqlite"

    def __call__(self, op: Callable[[], T]) -> T:
        lost_at: float | None = None
        pause = 0.5
        while True:
            try:
                result = op()
            except Exception as exc:
                if not self.enabled or not connection_lost(exc):
                    raise
                now = time.monotonic()
                if lost_at is None:
                    lost_at = now
                    self.notice(
                        f"{self.shown}: lost the connection to the database ({_first_line(exc)}); "
                        f"reconnecting for up to {RECONNECT_S:g} s"
                    )
                if now - lost_at > RECONNECT_S:
                    raise StorageError(
                        f"{self.shown}: no connection to the database for {now - lost_at:.0f} s "
                        f"({_first_line(exc)}); check that the server runs, then run the same "
                        "command again to resume (every finished trial is kept)"
                    ) from None
                time.sleep(pause)
                pause = min(2 * pause, 8.0)
                continue
            if lost_at is not None:
                self.notice(f"{self.shown}: reconnected after {time.monotonic() - lost_at:.0f} s")
            return result


class ClaimLock:
    """Serialises the claims of every driver of one storage (see the module docstring).

    Use as a context manager around one turn; :meth:`check` before claiming."""

    def __init__(self, url: str, notice: Callable[[str], None] = print) -> None:
        u = make_url(url)
        self.backend = u.get_backend_name()
        self.notice = notice
        self.fd: int | None = None
        self.conn: sqlalchemy.Connection | None = None
        self.engine: sqlalchemy.Engine | None = None
        self.me = f"{os.getpid()}@{socket.gethostname()}"
        self._use = threading.Lock()  # the lock's connection: the main thread or the beat
        self._beat: threading.Thread | None = None
        self._held = threading.Event()
        self.lost = False
        if self.backend == "sqlite":
            self.path: Path | None = Path(f"{u.database}.lock")
        else:
            self.path = None
            self.engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)

    # -- the lock ------------------------------------------------------------------------------

    def __enter__(self) -> ClaimLock:
        if self.path is not None:
            self._flock()
        elif self.backend == "postgresql":
            self._pg_lock()
        else:
            self._execute(
                "SELECT GET_LOCK(CONCAT('autoshard-', :k), :t)", k=LOCK_KEY, t=int(LOCK_TIMEOUT_S)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None and fcntl is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        self._held.clear()
        if self.conn is not None:
            sql = {
                "postgresql": "SELECT pg_advisory_unlock(:k)",
                "mysql": "SELECT RELEASE_LOCK(CONCAT('autoshard-', :k))",
            }[self.backend]
            with contextlib.suppress(sqlalchemy.exc.SQLAlchemyError):
                self._execute(sql, k=LOCK_KEY)

    def check(self) -> None:
        """Raise :class:`ClaimLost` when the lock was taken from this driver during its turn
        (its session ended by a driver that took it for dead)."""
        if self.backend != "postgresql" or not self._held.is_set():
            return
        try:
            self._execute("SELECT 1")
        except sqlalchemy.exc.SQLAlchemyError:
            self.lost = True
        if self.lost:
            self._drop()
            raise ClaimLost(f"driver {self.me} lost its claim lock while it held it")

    def close(self) -> None:
        self._held.clear()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._drop()
        if self.engine is not None:
            self.engine.dispose()

    # -- internals -----------------------------------------------------------------------------

    def _flock(self) -> None:
        assert self.path is not None
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise StorageError(
                    f"{self.path}: cannot create the lock next to the study database "
                    f"({exc.strerror or exc}); its folder must be writable"
                ) from None
        if fcntl is not None:
            fcntl.flock(self.fd, fcntl.LOCK_EX)

    def _execute(self, sql: str, **params: object) -> object:
        """One statement on the lock's connection (opened when there is none; dropped when it
        fails, so that the next call opens a fresh one)."""
        with self._use:
            try:
                if self.conn is None:
                    assert self.engine is not None
                    self.conn = self.engine.connect()
                value = self.conn.execute(sqlalchemy.text(sql), params).scalar()
                self.conn.commit()  # the lock belongs to the session, not to a transaction
                return value
            except sqlalchemy.exc.SQLAlchemyError:
                self._drop_locked()
                raise

    def _drop(self) -> None:
        with self._use:
            self._drop_locked()

    def _drop_locked(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.invalidate()
                self.conn.close()
            self.conn = None

    def _pg_lock(self) -> None:
        started = time.monotonic()
        pause = _POLL_S[0]
        said = False
        while not self._execute("SELECT pg_try_advisory_lock(:k)", k=LOCK_KEY):
            waited = time.monotonic() - started
            holder = self._pg_holder()
            if holder is not None and holder[2] > STALE_S:
                pid, name, silent = holder
                try:
                    ended = self._execute("SELECT pg_terminate_backend(:p)", p=pid)
                except sqlalchemy.exc.SQLAlchemyError:
                    ended = False  # not allowed to (another user's session): wait for it
                if ended:
                    self.notice(
                        f"{_driver(name)} held the study's claim lock with no sign of life for "
                        f"{silent:.0f} s (stopped, or its connection cut): ended its database "
                        "session, which frees the lock; going on"
                    )
                    continue
            if waited > WAIT_NOTICE_S and not said:
                said = True
                who = _driver(holder[1]) if holder else "another driver"
                self.notice(
                    f"waiting for {who}, holding the claim{_since(holder)} (a holder silent for "
                    f"{STALE_S:g} s is taken for dead; a live one is waited for up to "
                    f"{LOCK_TIMEOUT_S:g} s)"
                )
            if waited > LOCK_TIMEOUT_S:
                who = _driver(holder[1]) if holder else "another driver"
                raise StorageError(
                    f"the study's claim lock has been held by {who} for over {waited:.0f} s while "
                    "it is alive; end that driver or wait for it, then run the same command again "
                    "to resume"
                )
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])
        since = time.strftime("%H:%M:%S")
        self._execute(
            "SELECT set_config('application_name', :n, false)",
            n=f"autoshard {self.me} since {since}",
        )
        self._held.set()
        self.lost = False
        if self._beat is None or not self._beat.is_alive():
            self._beat = threading.Thread(target=self._beats, daemon=True, name="autoshard-claim")
            self._beat.start()

    def _beats(self) -> None:
        """While the lock is held, a statement on its connection every BEAT_S: its
        ``query_start`` is the holder's sign of life that other drivers read."""
        while True:
            time.sleep(BEAT_S)
            if not self._held.is_set():
                if self.conn is None:
                    return
                continue
            try:
                self._execute("SELECT 1")
            except sqlalchemy.exc.SQLAlchemyError:
                self.lost = True

    def _pg_holder(self) -> tuple[int, str, float] | None:
        """The holder of the lock: its backend PID, application name and seconds since its
        connection last did anything; None when it cannot be seen."""
        sql = (
            "SELECT a.pid, a.application_name, CASE WHEN a.state = 'idle' THEN "
            "extract(epoch FROM now() - coalesce(a.state_change, a.backend_start)) ELSE 0 END "
            "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
            "AND l.classid = :hi AND l.objid = :lo"
        )
        with self._use:
            try:
                if self.conn is None:
                    return None
                row = self.conn.execute(
                    sqlalchemy.text(sql), {"hi": LOCK_KEY >> 32, "lo": LOCK_KEY & 0xFFFFFFFF}
                ).first()
                self.conn.commit()
            except sqlalchemy.exc.SQLAlchemyError:
                return None
        if row is None:
            return None
        return int(row[0]), str(row[1] or ""), float(row[2] or 0.0)


def _driver(application_name: str) -> str:
    """ "driver 1234@host" from a holder's application name."""
    parts = application_name.split()
    if len(parts) >= 2 and parts[0] == "autoshard":
        return f"driver {parts[1]}"
    return f"a database session ({application_name or 'unnamed'})"


def _since(holder: tuple[int, str, float] | None) -> str:
    parts = holder[1].split() if holder else []
    return f" since {parts[3]}" if len(parts) >= 4 and parts[2] == "since" else ""


def _first_line(exc: BaseException) -> str:
    inner: BaseException = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    inner = getattr(inner, "orig", None) or inner
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return lines[0][:200] if lines else type(inner).__name__


def fail_stale(storage: RDBStorage, study: optuna.Study, study_id: int, me: dict[str, Any]) -> None:
    """Fail the RUNNING trials of drivers that are gone (``me``: this driver's owner record):
    on this machine, a driver with this output folder (whose lock this one holds) or whose
    process has ended; elsewhere, one whose heartbeat stopped for the grace period (optuna's
    fail_stale_trials)."""
    import warnings

    import optuna
    from optuna.trial import TrialState

    for t in storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
        owner = t.user_attrs.get(OWNER_ATTR)
        if not isinstance(owner, dict):
            gone = True  # not claimed by autoshard's loop: nobody tends it
        elif owner.get("token") == me["token"]:
            gone = False
        elif owner.get("host") == me["host"]:
            gone = owner.get("out") == me["out"] or not pid_alive(int(owner.get("pid", 0)))
        else:
            gone = False
        if gone:
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


class Heartbeat:
    """Records optuna's heartbeat of the running trial every ``every`` seconds."""

    def __init__(self, storage: RDBStorage, trial_id: int, *, every: float) -> None:
        self.every = every
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._beat, args=(storage, trial_id), daemon=True, name="autoshard-heartbeat"
        )
        self.thread.start()

    def _beat(self, storage: RDBStorage, trial_id: int) -> None:
        while not self.stop.wait(self.every):
            # A missed beat is not an error: the claim's grace period is several beats long.
            with contextlib.suppress(Exception):
                storage.record_heartbeat(trial_id)

    def end(self) -> None:
        self.stop.set()
        self.thread.join(timeout=self.every)
