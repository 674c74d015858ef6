"""Where a study's optuna storage is, checked before anything slow: the ``--storage`` URL (its
driver installed, a kind autoshard keeps studies in), the output folder, a corrupt SQLite file
moved aside; and every database error as one line saying what to do."""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import sqlalchemy
from sqlalchemy.engine import URL, make_url

from autoshard.errors import MissingDependencyError, StorageError
from autoshard.ui.files import DATABASE_FILE

DB_NAME = DATABASE_FILE
SHARED_BACKENDS = ("sqlite", "postgresql", "mysql")
# A database driver whose import name is not what pip installs (`pip install MySQLdb` finds
# nothing): import name -> (the package, how to install it).
DRIVER_PACKAGES = {
    "MySQLdb": (
        "mysqlclient (import name MySQLdb)",
        "`pip install mysqlclient` (it builds against the MySQL client library), or `pip install "
        "pymysql` and write the URL as mysql+pymysql://user@host/dbname",
    ),
}
_EXAMPLE_URLS = "sqlite:///runs/study.db or postgresql://user@host/dbname"


def default_storage(out_dir: Path | str) -> str:
    return f"sqlite:///{(Path(out_dir) / DB_NAME).resolve()}"


def check_storage(url: str) -> str:
    """The URL optuna will open, its driver filled in (``postgresql://`` uses psycopg 3 when
    psycopg2 is not installed), or one line saying what is wrong with it. Cheap: call it before
    anything slow.

    >>> from autoshard.errors import StorageError
    >>> check_storage("postgresql://me@db/x").split("@")[0]  # with autoshard[postgres] installed
    'postgresql://me'
    >>> try:
    ...     check_storage("notaurl")
    ... except StorageError as error:
    ...     print(str(error)[:45])
    --storage 'notaurl': not a database URL; give
    """
    try:
        u = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError):
        raise StorageError(
            f"--storage {url!r}: not a database URL; give e.g. {_EXAMPLE_URLS}"
        ) from None
    shown = f"--storage {u.render_as_string(hide_password=True)}"
    backend = u.get_backend_name()
    if backend == "sqlite":
        _check_sqlite_path(u, shown)
    elif (
        backend == "postgresql"
        and u.get_driver_name() == "psycopg2"
        and not _importable("psycopg2")
        and _importable("psycopg")
    ):
        # SQLAlchemy < 2.1 takes psycopg2 for postgresql://; autoshard[postgres] installs
        # psycopg 3 (binary wheels everywhere), which SQLAlchemy names postgresql+psycopg.
        u = u.set(drivername="postgresql+psycopg")
    try:
        u.get_dialect().import_dbapi()
    except sqlalchemy.exc.NoSuchModuleError:
        raise StorageError(
            f"{shown}: unknown database kind {u.drivername!r}; give e.g. {_EXAMPLE_URLS}"
        ) from None
    except ImportError as exc:
        extra = "postgres" if backend == "postgresql" else None
        package = "psycopg" if extra else (exc.name or u.get_driver_name())
        feature = f"{shown.split('://')[0]}://"
        if package in DRIVER_PACKAGES:
            package, install = DRIVER_PACKAGES[package]
            raise MissingDependencyError(package, feature, install=install) from None
        raise MissingDependencyError(package, feature, extra=extra) from None
    if backend not in SHARED_BACKENDS:
        raise StorageError(
            f"{shown}: autoshard keeps studies in SQLite, PostgreSQL or MySQL; give e.g. "
            f"{_EXAMPLE_URLS}"
        )
    return u.render_as_string(hide_password=False)


def _check_sqlite_path(u: URL, shown: str) -> None:
    db = u.database
    if not db or db == ":memory:" or db.startswith("file::memory:"):
        raise StorageError(
            f"{shown}: an in-memory database keeps nothing between runs; give a file, e.g. "
            "sqlite:///runs/study.db, or leave --storage out to keep the study in --out"
        )
    path = Path(db)
    if path.is_dir():
        raise StorageError(f"{shown}: {path} is a folder; give a file in it, e.g. {path}/study.db")
    if not path.parent.is_dir():
        raise StorageError(
            f"{shown}: the folder {path.parent} does not exist; create it, or leave --storage "
            "out to keep the study in --out"
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def prepare_out(out_dir: Path | str) -> Path:
    """Create the output folder, or say in one line why it cannot be used."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise StorageError(
            f"--out {out}: a file is in the way (a folder is needed); remove it or give "
            "another --out"
        ) from None
    except OSError as exc:
        raise StorageError(
            f"--out {out}: cannot create it ({exc.strerror or exc}); choose a writable folder "
            "with --out"
        ) from None
    if not out.is_dir():
        raise StorageError(f"--out {out}: not a folder; give a folder with --out")
    return out


def corrupt(exc: BaseException) -> bool:
    text = str(getattr(exc, "orig", exc)).lower()
    return "not a database" in text or "malformed" in text or "file is encrypted" in text


def move_aside(db: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = db.with_name(f"{db.name}.corrupt-{stamp}")
    db.rename(aside)
    for suffix in ("-journal", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            db.with_name(db.name + suffix).rename(aside.with_name(aside.name + suffix))
    return aside


@contextlib.contextmanager
def db_errors(shown: str) -> Iterator[None]:
    """A database error as one line: where, what the database said, what to do."""
    try:
        yield
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
        raise StorageError(db_problem(shown, exc)) from None


def db_problem(shown: str, exc: BaseException) -> str:
    cause: BaseException = exc
    while isinstance(cause, optuna.exceptions.StorageInternalError) and cause.__cause__:
        cause = cause.__cause__
    first = first_line(cause)
    low = first.lower()
    if "readonly" in low or "read-only" in low:
        advice = "make it writable, or choose another --out (or --storage)"
    elif "disk is full" in low or "no space" in low or "disk full" in low:
        advice = "free some space, then run the same command again to resume"
    elif "unable to open" in low:
        advice = "check that its folder exists and is writable"
    elif "connect" in low or "connection" in low or "password" in low:
        advice = "check that the database server runs and the URL (host, port, user, database)"
    elif "not a database" in low or "malformed" in low:
        advice = "move it away; autoshard rebuilds the study from trials.jsonl"
    else:
        advice = "run with --debug for the whole error"
    return f"{shown}: {first}; {advice}"


def first_line(exc: BaseException) -> str:
    inner = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(inner).__name__
