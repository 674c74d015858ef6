"""The driver side of trials: a worker group started once and fed one trial after another.

The group is ``python -m torch.distributed.run`` running :mod:`autoshard.trials.worker` on every
rank:
NCCL on the visible GPUs, or gloo with CPU processes where there is none. Launching a group costs
seconds (about 5 s for 2 gloo processes on a 2-core machine, more with CUDA and NCCL), so it is
started once per study and kept. Requests and results are small JSON files in a control folder
that rank 0 reads and writes.

What can go wrong, and what happens:
- an OOM (or a CPU memory cap passed) on any rank: every rank records it, memory is released,
  the same group takes the next trial;
- a rank crashes (the launcher exits): the trial is recorded as ``error`` with the end of the
  workers' log, and the next trial starts a fresh group;
- a hang (no result within ``trial_timeout``): the whole process group is killed, the trial is
  recorded as ``timeout``, and the next trial starts a fresh group.
A failed trial is a result, never an exception.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from autoshard.config import Candidate, WorkloadSpec
from autoshard.errors import ConfigError
from autoshard.results import TrialResult, TrialStatus
from autoshard.target.resolve import TargetSpec

LOG_TAIL_CHARS = 2000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_nproc() -> tuple[int, str]:
    """Processes per node and the device they use: every visible GPU, or 2 CPU processes."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count(), "cuda"
    return 2, "cpu"


def _descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the field after the ")" that closes the command name: state, then the parent id
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class WorkerGroup:
    """A persistent group of trial workers. Use as a context manager."""

    def __init__(
        self,
        target: TargetSpec,
        *,
        log_dir: Path,
        nproc: int | None = None,
        nnodes: int = 1,
        node_rank: int = 0,
        rdzv_endpoint: str | None = None,
        trial_timeout: float = 300.0,
        start_timeout: float = 180.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.target = target
        self.log_dir = Path(log_dir)
        self.nproc, self.device = (nproc, default_nproc()[1]) if nproc else default_nproc()
        self.nnodes, self.node_rank = nnodes, node_rank
        self.rdzv_endpoint = rdzv_endpoint
        self.trial_timeout, self.start_timeout = trial_timeout, start_timeout
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.control: Path | None = None
        self.log_path: Path | None = None
        self.launches = 0
        self._n = 0

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def command(self) -> list[str]:
        """The launcher command line of this node."""
        assert self.control is not None
        if self.nnodes > 1:
            # Static rendezvous: node ranks are the ones given, so global rank 0 (which reads
            # the driver's requests) is always on node 0, where the driver and its control
            # folder are. c10d's dynamic rendezvous would assign node ranks by arrival.
            if not self.rdzv_endpoint:
                raise ConfigError("several nodes need --rdzv-endpoint host:port of node 0")
            host, _, port = self.rdzv_endpoint.rpartition(":")
            rdzv = ["--rdzv-backend=static", f"--master-addr={host}", f"--master-port={port}"]
        else:
            rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--nproc-per-node={self.nproc}",
            *rdzv,
            "--max-restarts=0",
            "--monitor-interval=0.5",
            "-m",
            "autoshard.trials.worker",
            "--control",
            str(self.control),
        ]

    def start(self) -> None:
        """Launch the group (a fresh control folder and log per launch)."""
        self.close()
        self.launches += 1
        launch = f"group-{self.launches}-{uuid.uuid4().hex[:6]}"
        self.control = self.log_dir / launch
        self.control.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{launch}.log"
        self._n = 0
        env = {**os.environ, **self.env}
        # Workers import the target's files from the caller's folder, as the caller did.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
        env["AUTOSHARD_DRIVER_PID"] = str(os.getpid())  # workers stop when the driver dies
        env.setdefault("OMP_NUM_THREADS", "1" if self.device == "cpu" else "4")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: killed as one
            )

    def close(self) -> None:
        """Ask the workers to stop; kill them if they do not."""
        if self.proc is None:
            return
        if self.proc.poll() is None and self.control is not None:
            self._write_request({"stop": True})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        self._kill()

    def _kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # torchrun starts each worker in a session of its own (start_new_session in torch's
            # SubprocessHandler), so killing torchrun's group alone leaves a hung worker running
            # under init: kill the workers' groups too, found before their parent dies.
            workers = _descendants(self.proc.pid)
            for pid in [self.proc.pid, *workers]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def serve(self, *, max_launches: int = 1000) -> None:
        """On a node other than 0: run this node's workers until the driving node stops them.

        When node 0 kills its group after a crash or a hang, the workers here fail in their
        next collective and exit; they are launched again to join node 0's fresh group. A clean
        exit (exit code 0) is node 0's stop request."""
        if self.node_rank == 0:
            raise ConfigError("node 0 drives the study; serve() is for the other nodes")
        for _ in range(max_launches):
            self.start()
            assert self.proc is not None
            if self.proc.wait() == 0:
                break
        self.proc = None

    # -- trials --------------------------------------------------------------------------------

    def run(
        self,
        candidate: Candidate,
        workload: WorkloadSpec,
        *,
        warmup: int = 2,
        steps: int = 3,
        memory_cap: int | None = None,
        target: TargetSpec | None = None,
    ) -> TrialResult:
        """Run one trial; a failure of any kind comes back as a TrialResult, never raised."""
        started = time.monotonic()
        if not self.alive():
            self.start()
        request = {
            "n": self._n,
            "candidate": candidate.model_dump(mode="json"),
            "target": (target or self.target).model_dump(mode="json"),
            "seq_len": workload.seq_len,
            # the user's loop order and accumulation, run by the worker's step
            "loop": workload.loop.value,
            "accumulate": workload.accumulate,
            # The first trial of a fresh group also warms up the workers themselves (thread
            # pools, the allocator, the communicator's connections): measured here, its steps
            # ran up to 1.5x slower with the same warm-up, so it gets two more.
            "warmup": warmup + (2 if self._n == 0 else 0),
            "steps": steps,
            "memory_cap": memory_cap,
        }
        self._write_request(request)
        result_path = self._control() / f"result-{self._n}.json"
        self._n += 1
        deadline = started + self.trial_timeout + (self.start_timeout if self._n == 1 else 0)
        while not result_path.exists():
            if not self.alive():
                return self._failed(candidate, TrialStatus.ERROR, started, "workers exited")
            if time.monotonic() > deadline:
                self._kill()
                return self._failed(
                    candidate,
                    TrialStatus.TIMEOUT,
                    started,
                    f"no result within {self.trial_timeout:.0f} s; the worker group was killed",
                )
            time.sleep(0.05)
        data = json.loads(result_path.read_text())
        return self._result(candidate, data, time.monotonic() - started)

    def _control(self) -> Path:
        assert self.control is not None
        return self.control

    def _write_request(self, request: dict[str, Any]) -> None:
        n = request.get("n", self._n)
        path = self._control() / f"request-{n}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(request))
        os.replace(tmp, path)

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_bytes()[-LOG_TAIL_CHARS * 4 :].decode(errors="replace")
        return text[-LOG_TAIL_CHARS:]

    def _failed(
        self, candidate: Candidate, status: TrialStatus, started: float, why: str
    ) -> TrialResult:
        self._kill()
        tail = self.log_tail()
        detail = _last_error_line(tail)
        return TrialResult(
            candidate=candidate,
            status=status,
            device=self.device,
            world_size=self.world_size,
            error=f"{why}: {detail}" if detail else why,
            duration=time.monotonic() - started,
        )

    def _result(self, candidate: Candidate, data: dict[str, Any], duration: float) -> TrialResult:
        status = TrialStatus(data["status"])
        return TrialResult(
            candidate=candidate,
            status=status,
            device=self.device,
            world_size=data.get("world_size", self.world_size),
            step_time=data.get("step_time"),
            step_times=tuple(data.get("step_times") or ()),
            samples_per_s=data.get("samples_per_s"),
            tokens_per_s=data.get("tokens_per_s"),
            peak_allocated=tuple(data.get("peak_allocated") or ()),
            peak_reserved=tuple(data.get("peak_reserved") or ()),
            losses=tuple(data.get("losses") or ()),
            error=data.get("error"),
            duration=duration,
        )


def _last_error_line(log: str) -> str:
    """The most telling line of a worker log: the last exception or signal message."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if ("Error" in line or "Signal" in line or "exitcode" in line) and len(line) < 400:
            return line
    return lines[-1][:300] if lines else ""
