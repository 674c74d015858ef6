"""The messages between the driver (:mod:`.group`) and the workers (:mod:`.worker`), typed, and
the one way every one of them is written to disk.

The files in a group's control folder (a fresh folder per launch, on the driver's node):

- ``launch.json``, driver -> every rank of this node, written before the launch: :class:`Launch`;
- ``ready.json``, rank 0 -> driver, once every rank has joined: :class:`Ready`;
- ``request-N.json``, driver -> rank 0 (N counts from 0): :class:`TrialRequest` or
  :class:`StopRequest`;
- ``result-N.json``, rank 0 -> driver: :class:`TrialReply`;
- ``failed-N-rankR.json``, a rank whose trial failed while the other ranks wait for it in a
  collective -> driver: :class:`RankReport`. The rank then ends its process (and with it the
  group): the only way out of a collective that will never complete.

Between the ranks: rank 0 broadcasts the request (or an :class:`IdleTick` while the driver has
nothing to ask, so that no rank waits in one collective for longer than the collective timeout),
and gathers one :class:`RankReport` per rank.

>>> from autoshard import Candidate, TargetSpec, WorkloadSpec
>>> request = TrialRequest(n=0, candidate=Candidate(), target=TargetSpec(spec="m.py:build"),
...                        workload=WorkloadSpec(seq_len=64))
>>> parse_request(request.model_dump_json()) == request
True
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, TypeAdapter

from autoshard.config import (
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_STEPS,
    DEFAULT_TARGET_SPREAD,
    Candidate,
    Frozen,
    WorkloadSpec,
)
from autoshard.results import TrialStatus
from autoshard.target.resolve import TargetSpec

M = TypeVar("M", bound=BaseModel)


class Launch(Frozen):
    """What every worker of one launch needs before its first request."""

    driver_pid: int = Field(
        ..., description="The process that launched the group; workers end when it is gone."
    )
    collective_timeout: float = Field(
        ..., gt=0, description="Seconds a rank may wait in one collective (gloo/NCCL timeout)."
    )
    agree_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a failed rank waits for the others to finish the trial too; past "
        "it they are taken to be stuck in a collective, and the rank ends the group.",
    )
    idle_tick: float = Field(
        5.0, gt=0, description="Seconds between the idle ticks rank 0 sends while it waits."
    )
    warm_up: bool = Field(
        True, description="Throwaway steps before a target's first trial (see worker.warm_up)."
    )
    store: str | None = Field(
        None,
        description="127.0.0.1:PORT of the driver's store, on which a single node's workers form "
        "their process group (autoshard.trials.rendezvous); None: torchrun's (several nodes).",
    )


class Ready(Frozen):
    """Rank 0's word that every rank has joined the process group."""

    world_size: int = Field(..., ge=1, description="Ranks in the group.")


class TrialRequest(Frozen):
    """One trial to run."""

    kind: Literal["trial"] = "trial"
    n: int = Field(..., ge=0, description="The request's number within its launch.")
    candidate: Candidate
    target: TargetSpec
    workload: WorkloadSpec
    warmup: int = Field(2, ge=0, description="Untimed steps before the timed ones.")
    steps: int = Field(3, ge=1, description="Timed steps at least.")
    target_spread: float = Field(
        DEFAULT_TARGET_SPREAD,
        ge=0,
        description="Time until the median is known to this (0: until the budget is spent).",
    )
    max_steps: int = Field(DEFAULT_MAX_STEPS, ge=1, description="Most timed steps.")
    max_seconds: float = Field(DEFAULT_MAX_SECONDS, gt=0, description="Most timed seconds.")
    memory_cap: int | None = Field(
        None, description="Bytes a rank may use at its peak; past it the trial is an OOM."
    )


class StopRequest(Frozen):
    """The driver is done: the workers leave the process group and exit 0."""

    kind: Literal["stop"] = "stop"
    n: int = Field(..., ge=0, description="The request's number within its launch.")


class IdleTick(Frozen):
    """Rank 0 to the other ranks: no request yet, wait again."""

    kind: Literal["idle"] = "idle"


Request = Annotated[TrialRequest | StopRequest, Field(discriminator="kind")]
_REQUEST: TypeAdapter[TrialRequest | StopRequest] = TypeAdapter(Request)


def parse_request(text: str) -> TrialRequest | StopRequest:
    return _REQUEST.validate_json(text)


class RankReport(Frozen):
    """What one rank measured in one trial, or how it failed there."""

    rank: int = Field(..., ge=0)
    status: TrialStatus
    error: str | None = Field(None, description="One line: the exception's type and message.")
    traceback: str | None = None
    failed_at: float | None = Field(
        None, description="time.time() when the rank failed: the earliest failure is the cause."
    )
    step_times: tuple[float, ...] = Field((), description="Seconds of each timed step.")
    allocated: int = Field(0, description="Peak bytes the trial allocated on this rank.")
    reserved: int = Field(0, description="Peak bytes reserved on this rank.")
    samples: int = Field(0, description="Samples of this rank's micro-batch.")
    tokens: int | None = Field(None, description="Tokens of this rank's micro-batch.")
    losses: tuple[float, ...] = Field((), description="The loss at every step.")
    baseline: int = Field(0, description="Bytes allocated on this rank when the trial started.")
    leftover: int = Field(0, description="Bytes allocated on this rank after its release.")

    @property
    def ok(self) -> bool:
        return self.status is TrialStatus.OK


class TrialReply(Frozen):
    """Rank 0's summary of one trial over every rank."""

    n: int = Field(..., ge=0)
    status: TrialStatus
    world_size: int = Field(..., ge=1)
    step_times: tuple[float, ...] = Field((), description="Per step, the slowest rank's time.")
    step_time: float | None = Field(None, description="Median of step_times.")
    step_time_spread: float | None = Field(
        None, description="Relative half-width of the median's 95% interval."
    )
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    peak_allocated: tuple[int, ...] = ()
    peak_reserved: tuple[int, ...] = ()
    losses: tuple[float, ...] = Field((), description="Rank 0's loss at every step.")
    error: str | None = Field(None, description="'rank R: Type: message' of a failed trial.")
    raised_on: int | None = Field(
        None, description="How many ranks raised the first failing rank's error (an error trial)."
    )
    traceback: str | None = None
    baseline_bytes: tuple[int, ...] = Field(
        (), description="Per rank, bytes allocated when the trial started."
    )
    leftover_bytes: tuple[int, ...] = Field(
        (), description="Per rank, bytes still allocated after the trial was released."
    )


def write_json_atomically(path: Path, data: BaseModel | Any) -> None:
    """Write ``data`` (a pydantic model, or anything ``json.dumps`` takes) with
    :func:`write_text_atomically`."""
    text = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    write_text_atomically(Path(path), text)


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the whole new one, never
    a part, even across a crash, a full disk or a power cut: a temporary file next to it,
    flushed to disk, renamed over ``path``. Raises OSError (the temporary file removed)."""
    # pid + time: two writers of one path never share a temporary file
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    # the rename itself is durable once the folder is synced (POSIX; not possible on Windows)
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_message(path: Path, model: type[M]) -> M:
    return model.model_validate_json(Path(path).read_text(encoding="utf-8"))
