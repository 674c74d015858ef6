"""The workers' typed protocol (autoshard/trials/protocol.py): messages round-trip through their
files and refuse what they do not know; the atomic writer."""

from __future__ import annotations

import json
import os
import threading

import pytest

from autoshard.config import Candidate, WorkloadSpec
from autoshard.target.resolve import TargetSpec
from autoshard.trials.protocol import (
    Launch,
    StopRequest,
    TrialReply,
    TrialRequest,
    parse_request,
    read_message,
    write_json_atomically,
)


def _request(n: int = 0) -> TrialRequest:
    return TrialRequest(
        n=n,
        candidate=Candidate(precision="32-true", micro_batch_size=2),
        target=TargetSpec(spec="m.py:build", kwargs={"size": "tiny"}),
        workload=WorkloadSpec(seq_len=64),
        memory_cap=2**30,
    )


def test_requests_round_trip_through_their_files(tmp_path) -> None:
    for message in (_request(3), StopRequest(n=4)):
        write_json_atomically(tmp_path / "request.json", message)
        assert parse_request((tmp_path / "request.json").read_text()) == message
    reply = TrialReply(n=1, status="ok", world_size=2, step_times=(0.1, 0.2), step_time=0.15)
    write_json_atomically(tmp_path / "result.json", reply)
    assert read_message(tmp_path / "result.json", TrialReply) == reply


def test_messages_refuse_what_they_do_not_know() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        parse_request('{"kind": "trial", "n": 0}')  # no candidate, target, workload
    with pytest.raises(ValidationError):
        parse_request(json.dumps({"kind": "stop", "n": 0, "now": True}))  # extra field
    with pytest.raises(ValidationError):
        parse_request('{"kind": "reboot", "n": 0}')


def test_a_reader_never_sees_part_of_a_file_being_written(tmp_path) -> None:
    path, big = tmp_path / "result.json", {"losses": [0.123456789] * 50_000}
    write_json_atomically(path, big)
    done, partial = threading.Event(), []

    def write() -> None:
        for _ in range(40):
            write_json_atomically(path, big)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    while not done.is_set():
        try:
            json.loads(path.read_text())
        except json.JSONDecodeError:
            partial.append(1)
    writer.join()
    assert not partial


def test_the_atomic_writer_leaves_no_part_and_keeps_the_old_file_on_failure(tmp_path) -> None:
    path = tmp_path / "x.json"
    write_json_atomically(path, {"a": 1})
    write_json_atomically(path, Launch(driver_pid=1, collective_timeout=5))
    assert read_message(path, Launch).driver_pid == 1
    with pytest.raises(TypeError):
        write_json_atomically(path, {"not json": object()})
    assert read_message(path, Launch).driver_pid == 1  # the last good content, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]  # no temporary left


def test_the_atomic_writer_reports_a_missing_folder_and_survives_an_unsyncable_one(
    tmp_path, monkeypatch
) -> None:
    # nothing was written, so nothing is left to remove: the writer's own error, not a cleanup's
    with pytest.raises(FileNotFoundError):
        write_json_atomically(tmp_path / "missing" / "result-0.json", {"n": 0})

    # a folder that cannot be opened for its sync (Windows): the file is written all the same
    def no_folder(*args: object, **kwargs: object) -> int:
        raise OSError("cannot open a folder")

    monkeypatch.setattr(os, "open", no_folder)
    write_json_atomically(tmp_path / "result-1.json", {"n": 1, "error": "CUDA — 2 GiB"})
    monkeypatch.undo()
    assert json.loads((tmp_path / "result-1.json").read_text(encoding="utf-8"))["n"] == 1
