"""The driver side of trials: a worker group started once and fed one trial after another.

The group is ``python -m torch.distributed.run`` running :mod:`autoshard.trials.worker` on every
rank: NCCL on the visible GPUs, or gloo with CPU processes where there is none. Launching a
group costs seconds (about 5 s for 2 gloo processes on a 2-core machine, more with CUDA and
NCCL), so it is started once per study and kept. Requests and results are small JSON files in a
control folder that rank 0 reads and writes (:mod:`autoshard.trials.protocol`).

Two deadlines: ``start_timeout`` for a launch (until every rank is up and warmed up), and
``trial_timeout`` for every trial, from its request to its result, the first trial of a fresh
group included.

What can go wrong, and what happens:
- an OOM (or a CPU memory cap passed) or an exception on every rank: every rank records it,
  memory is released, the same group takes the next trial;
- an exception on some ranks only: the others wait for them in a collective, so the failed
  rank keeps its error in the control folder and ends the group; the trial is recorded with
  that rank's error, and the next trial starts a fresh group;
- a rank dies (the launcher exits): the trial is recorded as ``error`` with the line of the
  workers' log that tells why; ``transient`` when a signal killed it (the OOM killer, a node
  problem: trying again may work); the next trial starts a fresh group;
- a hang (no result within ``trial_timeout``): every process of the group is killed, the trial
  is recorded as ``timeout``, and the next trial starts a fresh group;
- a trial that leaves memory allocated (:mod:`autoshard.trials.isolation`): the next trial
  starts a fresh group, said in one line; an OOM of a candidate predicted to fit, in a group
  that ran other trials first, is tried once more in a fresh group (``run(retry_oom=True)``);
- Ctrl-C or any exception in the driver: the group is killed at once, and the exception goes
  on; a killed driver takes its workers with it (:mod:`autoshard.trials.lifeline`).
A failed trial is a result, never an exception.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pydantic import ValidationError

from autoshard.child_env import child_env
from autoshard.config import Candidate, WorkloadSpec
from autoshard.errors import AutoshardError, ConfigError, TrialNotice
from autoshard.options import TuneOptions
from autoshard.results import TrialResult, TrialStatus
from autoshard.target.resolve import TargetSpec
from autoshard.trials.crashlog import (
    LAUNCHER_SIGNAL,
    crash_cause,
    last_error_line,
    signal_name,
)
from autoshard.trials.isolation import leftover_margin, worst_excess
from autoshard.trials.lifeline import kill_tree, parent_death_preexec
from autoshard.trials.logcap import CappedLog, pump, read_tail
from autoshard.trials.protocol import (
    Launch,
    RankReport,
    Ready,
    StopRequest,
    TrialReply,
    TrialRequest,
    read_message,
    write_json_atomically,
)
from autoshard.trials.rendezvous import (
    TORCHRUN_ENV,
    LoopbackStore,
    torchrun_arguments,
    worker_environment,
)
from autoshard.units import format_bytes

LOG_TAIL_CHARS = 4000
POLL_SECONDS = 0.05
STOP_WAIT_SECONDS = 10.0  # a clean stop: the workers leave the process group and exit


def _warn(line: str) -> None:
    warnings.warn(line, TrialNotice, stacklevel=4)


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


@dataclass(frozen=True)
class _Trial:
    """One trial's request as :meth:`WorkerGroup.run` was given it (a retry sends it again)."""

    candidate: Candidate
    workload: WorkloadSpec
    memory_cap: int | None
    target: TargetSpec | None
    options: TuneOptions


class WorkerGroup:
    """A persistent group of trial workers. Use as a context manager."""

    def __init__(
        self,
        target: TargetSpec,
        options: TuneOptions | None = None,
        *,
        log_dir: Path,
        nnodes: int = 1,
        start_timeout: float = 180.0,
        agree_timeout: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        """A group for ``target``'s trials on ``nnodes`` nodes, its files in ``log_dir``. The
        trial settings come from ``options`` (:class:`autoshard.config.TuneOptions`): the
        processes per node (``nproc``; default: every visible GPU, or 2 CPU processes), this
        node's rank and the rendezvous endpoint of several nodes, the trial timeout, each
        trial's warm-up, steps and timing budget, the log cap per trial and ``on_notice`` (one
        line each: a restart for a trial's leftover, an OOM retried; default: a warning)."""
        self.options = opts = options or TuneOptions()
        self.target = target
        self.log_dir = Path(log_dir)
        nproc = opts.nproc
        self.nproc, self.device = (nproc, default_nproc()[1]) if nproc else default_nproc()
        self.nnodes, self.node_rank = nnodes, opts.node_rank
        self.rdzv_endpoint = opts.rdzv_endpoint
        self.trial_timeout, self.start_timeout = opts.trial_timeout, start_timeout
        self.agree_timeout = agree_timeout
        self.env = env or {}
        self.log_cap = opts.worker_log_cap
        self._rendezvous: LoopbackStore | None = None  # a single node's store (made at launch)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: CappedLog | None = None
        self._pump: threading.Thread | None = None
        self.control: Path | None = None
        self.log_path: Path | None = None
        self.ready: Ready | None = None
        self.launches = 0
        self.launch_seconds: float | None = None  # how long the last launch took to be ready
        self._launched_at = 0.0
        self._n = 0
        self._busy = False
        self.on_notice = opts.on_notice or _warn
        self._clean: tuple[int, ...] = ()  # per rank, what the launch's first trial started from
        self._restart_why: str | None = None  # the last trial left memory: restart before next
        self.last_index = 0  # the last trial's place in its launch (0: a fresh group's first)

    # -- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # Ctrl-C or an error in the driver: nothing to wait for
            self.kill()

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def collective_timeout(self) -> float:
        """How long a rank may wait in one collective: no longer than a launch and a whole trial
        take at most, when the driver has killed the group anyway."""
        return self.start_timeout + self.trial_timeout

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
            rdzv = [
                "--rdzv-backend=static",
                f"--master-addr={host}",
                f"--master-port={port}",
                # not torchrun's 600 s: a node whose node 0 is gone learns it within this
                f"--rdzv-conf=timeout={max(1, int(self.start_timeout))}",
            ]
        else:
            # The driver's store on 127.0.0.1: torchrun's own would listen on every interface.
            rdzv = torchrun_arguments(self._loopback_store().address, self.control.name)
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

    def _loopback_store(self) -> LoopbackStore:
        if self._rendezvous is None:
            self._rendezvous = LoopbackStore()
        return self._rendezvous

    def start(self) -> None:
        """Launch the group (a fresh control folder and log per launch). It returns at once;
        the first :meth:`run` waits until the group is ready, up to ``start_timeout``."""
        self.close()
        self.launches += 1
        launch = f"group-{self.launches}-{uuid.uuid4().hex[:6]}"
        self.control = self.log_dir / launch
        self.control.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{launch}.log"
        self.ready, self.launch_seconds = None, None
        self._n, self._busy = 0, False
        self._clean, self._restart_why = (), None
        write_json_atomically(
            self.control / "launch.json",
            Launch(
                driver_pid=os.getpid(),
                collective_timeout=self.collective_timeout,
                agree_timeout=self.agree_timeout,
                store=self._loopback_store().address if self.nnodes == 1 else None,
            ),
        )
        base = {**os.environ, **self.env}
        if self.nnodes == 1:  # nothing listens beyond loopback (autoshard.trials.rendezvous)
            base = {**worker_environment(), **base, **TORCHRUN_ENV}
        # Workers import the target's files from the caller's folder, as the caller did.
        env = child_env(os.getcwd(), base=base)
        env.setdefault("OMP_NUM_THREADS", "1" if self.device == "cpu" else "4")
        if self.device == "cpu":
            # A CPU trial's peak is read from the resident set. glibc raises its mmap threshold
            # each time a large block is freed, and blocks below it stay in the heap after they
            # are freed: the same trial then read 41 to 56 MiB per rank in one group (examples/
            # gpt.py tiny), depending on what ran before. Fixed at glibc's initial 128 KiB,
            # freed tensors leave the resident set: 28 MiB within 3%, closer to live tensors.
            env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
        self._launched_at = time.monotonic()
        # Through a pipe into a log bounded per trial (autoshard.trials.logcap).
        self._log = CappedLog(self.log_path, self.log_cap)
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: killed as one
            preexec_fn=parent_death_preexec(),  # and killed by the kernel with the driver
        )
        assert self.proc.stdout is not None
        self._pump = pump(os.dup(self.proc.stdout.fileno()), self._log)
        self.proc.stdout.close()

    def close(self) -> None:
        """Ask idle workers to stop; kill them if they do not, or if a trial is running."""
        if self.proc is None:
            return
        try:
            if self.alive() and self.ready is not None and not self._busy:
                self._write_request(StopRequest(n=self._n))
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=STOP_WAIT_SECONDS)
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill every process of the group now (no-op when there is none)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.proc.wait()
        self.proc, self._busy = None, False
        self._drain()

    def _drain(self, timeout: float = 5.0) -> None:
        """Wait until the log has all that the ended processes wrote."""
        if self._pump is not None:
            self._pump.join(timeout)
            self._pump = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def serve(self, *, max_launches: int = 1000) -> None:
        """On a node other than 0: run this node's workers until the driving node stops them.

        When node 0 kills its group after a crash or a hang, the workers here fail in their
        next collective and exit; they are launched again to join node 0's fresh group. A clean
        exit (exit code 0) is node 0's stop request. A launch that cannot join a group within
        ``start_timeout`` after this node had joined one means node 0 is gone (its driver was
        killed): serving stops with :class:`AutoshardError`."""
        if self.node_rank == 0:
            raise ConfigError("node 0 drives the study; serve() is for the other nodes")
        joined_before = False
        try:
            for _ in range(max_launches):
                self.start()
                assert self.proc is not None
                if self.proc.wait() == 0:
                    break
                joined = (self._control() / "joined.json").exists()
                if joined_before and not joined:
                    raise AutoshardError(
                        f"node {self.node_rank}: node 0 ({self.rdzv_endpoint}) formed no worker "
                        f"group within {self.start_timeout:g} s; its study is over or its driver "
                        "was killed: stopped serving"
                    )
                joined_before = joined_before or joined
        finally:
            self.kill()

    def wait_ready(self) -> str | None:
        """Wait for the launched group to be up, up to ``start_timeout`` after its launch;
        None when it is, else why not (the group is then killed)."""
        ready = self._control() / "ready.json"
        deadline = self._launched_at + self.start_timeout
        while not ready.exists():
            if not self.alive():
                return "the worker group exited while starting"
            if time.monotonic() > deadline:
                self.kill()
                return f"the worker group did not start within {self.start_timeout:g} s"
            time.sleep(POLL_SECONDS)
        self.ready = read_message(ready, Ready)
        self.launch_seconds = time.monotonic() - self._launched_at
        return None

    # -- trials --------------------------------------------------------------------------------

    def run(
        self,
        candidate: Candidate,
        workload: WorkloadSpec,
        *,
        memory_cap: int | None = None,
        target: TargetSpec | None = None,
        retry_oom: bool = False,
        options: TuneOptions | None = None,
    ) -> TrialResult:
        """Run one trial; a failure of any kind comes back as a TrialResult, never raised.
        (Ctrl-C and other exceptions of the driver itself kill the group and go on.)

        ``options`` (default: the group's) give the trial's warm-up and timing: at least
        ``steps`` steps are timed, then more until the median step time is known to within
        ``target_spread`` (relative, 95% confidence) or ``max_steps`` / ``max_seconds`` of timed
        steps are spent (:func:`autoshard.measure.enough_steps`).

        Isolation: a trial starts from what the group's first trial started from. When the
        last trial left more allocated than :func:`~autoshard.trials.isolation.leftover_margin`
        allows, the group is restarted first, said in one line (``on_notice``); a trial that
        still starts above it is ``contaminated``. ``retry_oom`` (the candidate is predicted to
        fit): an OOM in a group that ran other trials first is tried once more in a fresh
        group, said in one line, and the retry's result returned (``oom_retry``)."""
        trial = _Trial(candidate, workload, memory_cap, target, options or self.options)
        try:
            result = self._run(trial)
            if retry_oom and result.status is TrialStatus.OOM and self.last_index > 0:
                self.on_notice(
                    f"{candidate.label()} ran out of memory in a worker group that had run "
                    f"{self.last_index} trials before it: tried once more in a fresh group, "
                    "whose result is the one recorded"
                )
                self._end_for_restart()
                again = self._run(trial)
                result = again.model_copy(update={"oom_retry": True})
            return result
        except BaseException:
            self.kill()
            raise

    def _run(self, trial: _Trial) -> TrialResult:
        candidate, opts = trial.candidate, trial.options
        self._restart_if_left()
        if not self.alive():
            self.start()
        launch_seconds = 0.0
        if self.ready is None:
            started = time.monotonic()
            why = self.wait_ready()
            if why is not None:
                # The candidate never ran: that says nothing about it, so trying it again may
                # work (a busy machine, a port taken between choosing it and binding it).
                return self._crashed(candidate, started, None, why=why, transient=True)
            launch_seconds = self.launch_seconds or 0.0
        n = self.last_index = self._n
        request = TrialRequest(
            n=n,
            candidate=candidate,
            target=trial.target or self.target,
            workload=trial.workload,
            # The first trial of a fresh group also warms up the communicator's connections and
            # thread pools: measured here, its steps ran up to 1.5x slower with the same
            # warm-up, so it gets two more.
            warmup=opts.warmup + (2 if n == 0 else 0),
            steps=opts.steps,
            memory_cap=trial.memory_cap,
            target_spread=opts.target_spread,
            max_steps=opts.max_steps,
            max_seconds=opts.max_seconds,
        )
        self._busy = True
        started = time.monotonic()
        if self._log is not None:
            self._log.new_section()  # each trial's output is capped on its own
        self._write_request(request)
        self._n += 1
        result_path = self._control() / f"result-{n}.json"
        deadline = started + self.trial_timeout
        while not result_path.exists():
            if not self.alive():
                failed = self._crashed(candidate, started, n)
                return failed.model_copy(update={"launch_seconds": launch_seconds})
            if time.monotonic() > deadline:
                self.kill()
                elapsed = time.monotonic() - started
                detail = last_error_line(self.log_tail(), fallback=False)
                why = (
                    f"no result after {elapsed:.1f} s (trial timeout {self.trial_timeout:g} s); "
                    "the worker group was killed"
                )
                failed = self._failed(candidate, TrialStatus.TIMEOUT, started, why, detail)
                return failed.model_copy(update={"launch_seconds": launch_seconds})
            time.sleep(POLL_SECONDS)
        self._busy = False
        reply = read_message(result_path, TrialReply)
        return TrialResult(
            launch_seconds=launch_seconds,
            candidate=candidate,
            status=reply.status,
            device=self.device,
            world_size=reply.world_size,
            step_time=reply.step_time,
            step_times=reply.step_times,
            step_time_spread=reply.step_time_spread,
            samples_per_s=reply.samples_per_s,
            tokens_per_s=reply.tokens_per_s,
            peak_allocated=reply.peak_allocated,
            peak_reserved=reply.peak_reserved,
            losses=reply.losses,
            error=reply.error,
            raised_on=reply.raised_on,
            duration=time.monotonic() - started,
            baseline_bytes=reply.baseline_bytes,
            contaminated=self._check_levels(candidate, n, reply),
        )

    def _restart_if_left(self) -> None:
        """Close the group, with its line, when the last trial left memory (the next trial
        starts a fresh one)."""
        if self._restart_why is not None and self.alive():
            self.on_notice(self._restart_why)
            self._end_for_restart()
        self._restart_why = None

    def _end_for_restart(self) -> None:
        """End the group so that the next trial launches a fresh one: stopped on one node (its
        workers exit, their memory freed, before the next launch); killed across nodes, whose
        other nodes take a clean stop for the end of the study (:meth:`serve`) and relaunch to
        join node 0's next group after a kill."""
        if self.nnodes == 1:
            self.close()
        else:
            self.kill()

    def _check_levels(self, candidate: Candidate, n: int, reply: TrialReply) -> bool:
        """Whether the trial started contaminated (above the launch's first trial's level by
        more than the margin); and, when it left more than the margin allows, the restart of
        the group before the next trial, with its line."""
        if n == 0:
            self._clean = reply.baseline_bytes
        margin = leftover_margin(max(reply.peak_allocated, default=0))
        _, above = worst_excess(reply.baseline_bytes, self._clean)
        rank, left = worst_excess(reply.leftover_bytes, self._clean)
        if left > margin:
            self._restart_why = (
                f"{candidate.label()} left {format_bytes(left)} allocated on rank {rank} after it "
                f"ended, above the {format_bytes(self._clean[rank])} its worker group started "
                "from: the group is restarted before the next trial, which would otherwise "
                "start with that memory taken"
            )
        return n > 0 and above > margin

    def _control(self) -> Path:
        assert self.control is not None
        return self.control

    def _write_request(self, request: TrialRequest | StopRequest) -> None:
        write_json_atomically(self._control() / f"request-{request.n}.json", request)

    def log_tail(self) -> str:
        """The end of the log, read from its end (a log may be large)."""
        if self.log_path is None:
            return ""
        if not self.alive():
            self._drain()
        text = read_tail(self.log_path, LOG_TAIL_CHARS * 4).decode(errors="replace")
        return text[-LOG_TAIL_CHARS:]

    def rank_failures(self, n: int) -> list[RankReport]:
        """The failures that ranks kept in the control folder for request ``n``."""
        found = []
        for path in sorted(self._control().glob(f"failed-{n}-rank*.json")):
            with contextlib.suppress(OSError, ValidationError):
                found.append(read_message(path, RankReport))
        return found

    def _crashed(
        self,
        candidate: Candidate,
        started: float,
        n: int | None,
        *,
        why: str = "workers exited",
        transient: bool = False,
    ) -> TrialResult:
        """The group ended without a result: say why, from what the ranks left behind."""
        returncode = self.proc.poll() if self.proc is not None else None
        self.kill()  # reap the launcher; kill anything it left
        failures = self.rank_failures(n) if n is not None else []
        if failures:
            # a rank failed alone and ended the group: its error is the trial's
            first = min(failures, key=lambda r: (r.failed_at or 0.0, r.rank))
            failed = self._failed(
                candidate, first.status, started, f"rank {first.rank}", first.error or ""
            )
            same = sum(1 for r in failures if r.error == first.error)  # study/causes reads it
            raised_on = same if first.status is TrialStatus.ERROR else None
            return failed.model_copy(update={"raised_on": raised_on})
        tail = self.log_tail()
        cause = crash_cause(tail)
        who = f"rank {cause.rank}" if cause.rank is not None else "a worker"
        if cause.signal is not None:
            # killed from outside (the OOM killer, a node's trouble): trying again may work
            why, transient = f"{who} was killed by {signal_name(cause.signal)}", True
        elif cause.exitcode is not None:
            why = f"{why}: {who} exited with code {cause.exitcode}"
        elif returncode is not None and returncode < 0:  # the launcher itself was killed
            why, transient = f"torchrun was killed by {signal_name(-returncode)}", True
        elif stopped := LAUNCHER_SIGNAL.search(tail):  # torchrun stopped by SIGTERM, SIGINT...
            why = f"torchrun was stopped by {signal_name(int(stopped.group(1)))}"
            return self._failed(candidate, TrialStatus.ERROR, started, why, "", True)
        detail = last_error_line(tail, fallback=cause.exitcode is None)
        return self._failed(candidate, TrialStatus.ERROR, started, why, detail, transient)

    def _failed(
        self,
        candidate: Candidate,
        status: TrialStatus,
        started: float,
        why: str,
        detail: str = "",
        transient: bool = False,
    ) -> TrialResult:
        self.kill()
        return TrialResult(
            candidate=candidate,
            status=status,
            device=self.device,
            world_size=self.world_size,
            error=f"{why}: {detail}" if detail else why,
            transient=transient,
            duration=time.monotonic() - started,
        )
