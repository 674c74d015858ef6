"""Where a study's storage is (autoshard.study.database): every wrong --storage or --out is one
line saying what to do, and a database's error says what to do about it."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoshard.errors import StorageError
from autoshard.study.database import check_storage, db_problem, default_storage, prepare_out


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("notaurl", "not a database URL"),
        ("sqlite://", "in-memory database keeps nothing"),
        ("sqlite:///{tmp}/missing/study.db", "does not exist"),
        ("sqlite:///{tmp}", "is a folder"),
        ("nosuchdb://me@db/x", "unknown database kind"),
    ],
)
def test_a_wrong_storage_url_is_one_line(tmp_path: Path, url: str, says: str) -> None:
    with pytest.raises(StorageError) as raised:
        check_storage(url.format(tmp=tmp_path))
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_a_good_sqlite_url_and_the_default_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/study.db"
    assert check_storage(url) == url
    assert default_storage(tmp_path) == f"sqlite:///{tmp_path.resolve()}/study.db"


def test_the_output_folder_is_made_or_refused_in_one_line(tmp_path: Path) -> None:
    assert prepare_out(tmp_path / "a" / "b").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="a file is in the way"):
        prepare_out(tmp_path / "file")


@pytest.mark.parametrize(
    ("error", "advice"),
    [
        ("attempt to write a readonly database", "make it writable"),
        ("database or disk is full", "free some space"),
        ("could not connect to server", "check that the database server runs"),
        ("file is not a database", "autoshard rebuilds the study from trials.jsonl"),
        ("something else", "--debug"),
    ],
)
def test_a_database_error_says_what_to_do(error: str, advice: str) -> None:
    line = db_problem("--storage x", RuntimeError(f"{error}\nmore detail"))
    assert line.startswith(f"--storage x: {error};")
    assert advice in line and "more detail" not in line
