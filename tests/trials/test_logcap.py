"""A worker group's log bounded per trial (trials/logcap.py): each section keeps its first and
last half of the cap around one marker that says how much was left out; a short section is kept
whole; the pump copies a pipe into the log and closes both."""

from __future__ import annotations

import os
from pathlib import Path

from autoshard.trials.logcap import CappedLog, marker, pump, read_tail


def test_a_long_section_keeps_its_head_and_tail_around_one_marker(tmp_path: Path) -> None:
    log = CappedLog(tmp_path / "log", cap=100)
    data = bytes(range(256)) * 4  # 1,024 bytes, each position recognisable
    for start in range(0, len(data), 7):  # written in small pieces, as a pipe delivers them
        log.write(data[start : start + 7])
    log.close()
    text = (tmp_path / "log").read_bytes()
    left_out = len(data) - 100
    assert text == data[:50] + marker(left_out, 100) + data[-50:]


def test_each_section_is_capped_on_its_own_and_a_short_one_kept_whole(tmp_path: Path) -> None:
    log = CappedLog(tmp_path / "log", cap=40)
    log.write(b"a" * 200)
    log.new_section()
    log.write(b"short trial\n")
    log.close()
    text = (tmp_path / "log").read_bytes()
    assert text == b"a" * 20 + marker(160, 40) + b"a" * 20 + b"short trial\n"
    log.write(b"after close")  # a late write of the pump is dropped, not an error
    assert (tmp_path / "log").read_bytes() == text


def test_the_pump_copies_a_pipe_until_its_writers_are_gone(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    log = CappedLog(tmp_path / "log", cap=1 << 20)
    thread = pump(read_end, log)
    os.write(write_end, b"rank 0: step 1\n")
    os.write(write_end, b"rank 1: step 1\n")
    os.close(write_end)
    thread.join(timeout=10)
    assert not thread.is_alive() and log.fh.closed
    assert (tmp_path / "log").read_bytes() == b"rank 0: step 1\nrank 1: step 1\n"
    assert read_tail(tmp_path / "log", 7) == b"step 1\n"
    assert read_tail(tmp_path / "missing", 7) == b""


def test_a_section_ends_with_its_tail_cut_to_half_the_cap(tmp_path: Path) -> None:
    # The tail grows past half the cap between compactions (compacting on every write would
    # copy it each time): the next trial's start cuts it back.
    log = CappedLog(tmp_path / "log", cap=400)
    data = bytes(range(210)) * 5  # 1,050 bytes: 50 after the first compaction
    log.write(data[:1000])
    log.write(data[1000:])
    log.new_section()
    log.write(b"next trial\n")
    log.close()
    text = (tmp_path / "log").read_bytes()
    assert text == data[:200] + marker(650, 400) + data[-200:] + b"next trial\n"


def test_a_capped_log_keeps_each_trials_head_and_tail(tmp_path) -> None:
    from autoshard.trials.logcap import CappedLog, marker, read_tail

    path, cap = tmp_path / "group.log", 1000
    log = CappedLog(path, cap)
    first = b"".join(f"{n:05d}\n".encode() for n in range(2000))  # 12,000 bytes
    for at in range(0, len(first), 77):
        log.write(first[at : at + 77])
    log.new_section()
    log.write(b"second trial\n")
    log.close()
    text = path.read_bytes()
    head, _, rest = text.partition(b"\n[autoshard: ")
    assert head == first[:500]  # the first half of the cap
    kept_tail = rest.split(b"(--worker-log-cap)]\n", 1)[1].removesuffix(b"second trial\n")
    assert first.endswith(kept_tail) and len(kept_tail) >= 500
    left_out = len(first) - 500 - len(kept_tail)
    assert marker(left_out, cap) in text  # says exactly how much is missing
    assert text.endswith(b"second trial\n")  # the next trial's output is kept from its start
    assert len(text) < 500 + 2 * cap
    assert read_tail(path, 13) == b"second trial\n"
