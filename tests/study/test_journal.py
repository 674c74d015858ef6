"""The study's journal (autoshard.study.journal) by itself: what a full disk, an unwritable
folder, an interrupted write and a foreign line do to ``trials.jsonl``, and the one line each
gives the user. Quick: files in a temporary folder, the disk's failures raised on purpose."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import autoshard.study.journal as journal_mod
from autoshard.config import Candidate
from autoshard.errors import StorageError
from autoshard.results import TrialResult
from autoshard.study.journal import RESERVE_BYTES, Journal, read_records, record_line

OK = TrialResult(candidate=Candidate(micro_batch_size=2), status="ok", error="±3% spread")
LABEL = OK.candidate.label()


def _journal(tmp_path: Path) -> tuple[Journal, list[str]]:
    said: list[str] = []
    return Journal(tmp_path / "trials.jsonl", said.append), said


def _disk_fails(monkeypatch, code: int, times: int) -> None:
    """The next ``times`` writes fail with ``code`` (ENOSPC: the disk is full)."""
    real = journal_mod._write_all
    left = [times]

    def write_all(fd: int, data: bytes) -> None:
        if left[0] > 0:
            left[0] -= 1
            os.write(fd, data[:5])  # part of it got out: it must be taken back
            raise OSError(code, os.strerror(code))
        real(fd, data)

    monkeypatch.setattr(journal_mod, "_write_all", write_all)


def test_a_full_disk_records_the_trial_in_the_reserve_then_stops(tmp_path, monkeypatch) -> None:
    journal, _ = _journal(tmp_path)
    journal.keep_reserve()
    assert journal.reserve_path.stat().st_size == RESERVE_BYTES == 256 * 1024
    journal.append("s", OK)
    _disk_fails(monkeypatch, errno.ENOSPC, times=1)
    with pytest.raises(StorageError) as stopped:
        journal.append("s", OK)
    assert str(stopped.value) == (
        f"no space left on the device of {tmp_path}: the last trial ({LABEL}, ok) was recorded "
        "in trials.jsonl in the space autoshard kept in reserve; free some space, then run the "
        "same command again to resume"
    )
    assert not journal.reserve_path.exists()
    assert journal.read("s") == [OK, OK]  # both whole: the failed write was taken back


def test_a_full_disk_without_a_reserve_loses_nothing_and_says_so(tmp_path, monkeypatch) -> None:
    journal, _ = _journal(tmp_path)
    journal.append("s", OK)
    _disk_fails(monkeypatch, errno.ENOSPC, times=1)
    with pytest.raises(StorageError) as stopped:
        journal.append("s", OK)
    assert str(stopped.value) == (
        f"{journal.path}: no space left to record the trial of {LABEL} (ok) (No space left on "
        "device); free some space, then run the same command again (that trial runs again)"
    )
    assert journal.path.read_bytes() == record_line("s", OK)  # no half record left behind
    _disk_fails(monkeypatch, errno.EACCES, times=1)
    with pytest.raises(StorageError) as refused:
        journal.append("s", OK)
    assert str(refused.value) == (
        f"{journal.path}: cannot record the trial of {LABEL} (Permission denied); make the "
        "output folder writable, then run the same command again"
    )


def test_the_reserve_cannot_be_kept_on_a_full_disk_or_an_unwritable_folder(
    tmp_path, monkeypatch
) -> None:
    journal, _ = _journal(tmp_path)
    _disk_fails(monkeypatch, errno.ENOSPC, times=1)
    with pytest.raises(StorageError) as full:
        journal.keep_reserve()
    assert str(full.value) == (
        f"{tmp_path}: no space left on the device; free some space, then run the same command again"
    )
    assert not journal.reserve_path.exists()  # a partial reserve is no reserve
    _disk_fails(monkeypatch, errno.EROFS, times=1)
    with pytest.raises(StorageError) as readonly:
        journal.keep_reserve()
    assert str(readonly.value) == (
        f"{tmp_path}: cannot write there (Read-only file system); choose a writable folder "
        "with --out"
    )
    journal.keep_reserve()
    first = journal.reserve_path.read_bytes()
    journal.keep_reserve()  # kept as it is
    assert journal.reserve_path.read_bytes() == first and len(set(first)) > 1  # not zeros


def test_an_interrupted_write_is_cut_at_the_last_whole_record(tmp_path) -> None:
    journal, said = _journal(tmp_path)
    assert journal.repair() == 0 and journal.studies() == []  # no journal yet
    journal.path.write_bytes(b"")
    assert journal.repair() == 0
    # more than one 64 KiB block of records, then half a record (cut inside a UTF-8 character)
    whole = b"".join(record_line(f"s{i % 3}", OK) for i in range(300))
    partial = record_line("s9", OK)[: record_line("s9", OK).index("±".encode()) + 1]
    assert len(whole) > 64 * 1024
    journal.path.write_bytes(whole + partial)
    assert journal.studies() == ["s0", "s1", "s2"]  # the last whole record of each, in order
    assert journal.read() == [OK] * 300
    assert journal.repair() == len(partial)
    assert journal.path.read_bytes() == whole
    assert said == [
        f"{journal.path}: removed a partial last record ({len(partial)} bytes, left by an "
        "interrupted write); the complete records before it are kept"
    ]
    assert journal.repair() == 0 and len(said) == 1
    # a file that is nothing but half a record is cut to nothing
    journal.path.write_bytes(partial)
    assert journal.repair() == len(partial) and journal.path.read_bytes() == b""


def test_a_line_that_is_not_a_record_names_its_line(tmp_path) -> None:
    path = tmp_path / "trials.jsonl"
    path.write_bytes(record_line("s", OK) + b"\n[1, 2]\n" + record_line("s", OK))
    with pytest.raises(StorageError) as bad:
        read_records(path)
    assert str(bad.value) == (
        f"{path}:3: not a trial record; remove or fix that line (the file is append-only: "
        "every other line is a complete record)"
    )
    journal, _ = _journal(tmp_path)
    path.write_bytes(record_line("a", OK) + b'"text"\n' + record_line("b", OK) + b'{"study": 1}\n')
    assert journal.studies() == ["a", "b"]  # foreign lines name no study
    assert read_records(tmp_path / "none.jsonl") == []


def test_a_write_that_cannot_be_taken_back_still_ends_in_one_line(tmp_path, monkeypatch) -> None:
    journal, _ = _journal(tmp_path)
    _disk_fails(monkeypatch, errno.ENOSPC, times=1)

    def ftruncate(fd: int, length: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(journal_mod.os, "ftruncate", ftruncate)
    with pytest.raises(StorageError, match=r"no space left to record the trial of .*No space left"):
        journal.append("s", OK)


def test_the_reserve_is_an_ordinary_file_of_the_folder(tmp_path) -> None:
    journal, _ = _journal(tmp_path)
    journal.keep_reserve()
    umask = os.umask(0)
    os.umask(umask)
    assert journal.reserve_path.stat().st_mode & 0o777 == 0o644 & ~umask


def test_a_short_write_is_continued_until_the_record_is_whole(tmp_path, monkeypatch) -> None:
    # a write may take fewer bytes than given (a disk near full, a signal): the rest follows
    real = os.write
    monkeypatch.setattr(journal_mod.os, "write", lambda fd, data: real(fd, bytes(data[:100])))
    journal, _ = _journal(tmp_path)
    journal.append("s", OK)
    assert journal.read("s") == [OK] and len(record_line("s", OK)) > 300
