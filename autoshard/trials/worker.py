"""The worker side of a trial: run inside a process group started by ``torch.distributed.run``.

``python -m torch.distributed.run ... -m autoshard.trials.worker --control DIR`` starts one of
these per rank. They stay up for a whole study: rank 0 waits for ``DIR/request-N.json``,
broadcasts it, every rank runs the trial (build, shard, warm up, time, measure), and rank 0
writes ``DIR/result-N.json`` (the messages: :mod:`autoshard.trials.protocol`). A trial that fails
on every rank (an OOM, a bad config) is recorded and the workers go on. A trial that fails on
some ranks only leaves the others waiting in a collective that will never complete: the failed
rank writes its error to ``DIR/failed-N-rankR.json`` and ends the group, which the driver
(:mod:`autoshard.trials.group`) reports and relaunches, as it does when a rank dies or hangs.

A worker never outlives its driver, whatever it is doing (waiting for a request, in a trial, or
stuck in a collective): the kernel kills it when torchrun dies (``PR_SET_PDEATHSIG``, Linux), a
watchdog thread that needs nothing from the main thread ends it when the driver or torchrun is
gone, and no collective waits longer than the trial timeout allows.

Time: the median of the timed steps, on CUDA in wall seconds, on CPU in the process's CPU
seconds (see :func:`time_steps`), with the spread of that median.

Memory: each trial's own. On CUDA the allocator's ``max_memory_allocated`` /
``max_memory_reserved`` over the whole trial, above what was allocated / reserved when it started
(read after the previous trial's release, peak statistics reset after it). On CPU, the process
memory: "allocated" is how far the trial raised the process's peak resident set above where it
started (model, optimizer state, activations, buffers), "reserved" the peak resident set itself.
(torch's ``MemTracker`` would count tensors exactly, but it cannot follow FSDP1's parameter views:
"post accumulate grad hooks cannot be registered on non-leaf tensors".)
Each report also says how much was allocated before the trial and after its release: nothing of
a trial may outlive it (:mod:`autoshard.trials.isolation`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from autoshard.config import Candidate, Checkpointing, Engine, Precision, WorkloadSpec
from autoshard.loop import autocast_for, optimizer_step
from autoshard.results import TrialStatus
from autoshard.sharding import (
    apply_candidate,
    make_optimizer,
    rank_device,
    register_float8_scales,
)
from autoshard.target.resolve import (
    TargetSpec,
    build_target,
    exit_message,
    forget_kept_build,
    load_callable,
)
from autoshard.target.step import (
    compute_loss,
    find_loss_fn,
    forward,
    make_batch,
    with_labels,
)
from autoshard.trials.accounting import (
    check_cap,
    clear_peak_rss,
    current_rss,
    peak_allocated,
    peak_rss,
    step_counts,
    summarize,
    time_steps,
)
from autoshard.trials.isolation import dismantle, freeze_process, release
from autoshard.trials.lifeline import alive, die_with_parent, start_watchdog
from autoshard.trials.protocol import (
    IdleTick,
    Launch,
    RankReport,
    Ready,
    StopRequest,
    TrialRequest,
    parse_request,
    read_message,
    write_json_atomically,
)
from autoshard.trials.rendezvous import process_group_store

# Models up to this size are built for real on the CPU (exact initialisation, computed buffers
# kept); larger ones are built on meta and materialised shard by shard by FSDP.
REAL_BUILD_MAX_BYTES = 2 * 1024**3
POLL_SECONDS = 0.05


def init_states(module: nn.Module, device: torch.device) -> None:
    """Materialise one module's own (not its children's) meta parameters and buffers."""
    module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset) and next(module.parameters(recurse=False), None) is not None:
            reset()
        else:
            for p in module.parameters(recurse=False):
                p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
        for b in module.buffers(recurse=False):
            if b.is_floating_point():
                b.zero_()


def build_for_training(
    target: TargetSpec, candidate: Candidate, device: torch.device, seq_len: int | None
) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """Everything a training step needs, as the candidate says: the sharded model, its
    optimizer, a batch at the candidate's micro-batch size (with labels), and the target's loss
    function (None: the default loss)."""
    model, built_batch, data = build_sharded(target, candidate, device)
    optimizer = make_optimizer(model.parameters(), candidate)
    if candidate.float8:
        register_float8_scales(model, optimizer)
    batch = make_batch(
        model,
        built_batch,
        micro_batch_size=candidate.micro_batch_size,
        seq_len=seq_len,
        device=device,
        data=data,
    )
    batch = with_labels(model, batch)
    loss_fn = find_loss_fn(sys.modules.get(load_callable(target.spec).__module__))
    return model, optimizer, batch, loss_fn


def build_sharded(
    target: TargetSpec, candidate: Candidate, device: torch.device
) -> tuple[nn.Module, Any, Any]:
    """Build the target's model on this rank and apply the candidate to it; with its example
    batch and the user's data (a :class:`~autoshard.target.data.BatchSource`, made again here
    from the target: real batches whatever device the model was built on)."""
    built = build_target(target, device="meta")
    param_bytes = sum(p.numel() * p.element_size() for p in built.model.parameters())
    real = param_bytes <= REAL_BUILD_MAX_BYTES
    if real:
        torch.manual_seed(0)
        built = build_target(target, device="cpu")
    model, batch = built.model, built.batch
    if batch is not None and built.built_on == "meta" and built.data is None:
        batch = None  # a batch built on meta holds no data: synthesise one instead
    init = None if real else (lambda m: init_states(m, device))
    model = apply_candidate(model, candidate, device, param_init_fn=init)
    return model, batch, built.data


def run_trial(request: TrialRequest, device: torch.device, *, quiet: bool = False) -> RankReport:
    """Run one trial on this rank; return its local measurements or its failure (never raises).
    A failure is also printed, with its traceback, to this rank's log.

    The report says how much was allocated when the trial started (``baseline``) and after it
    was released (``leftover``): a trial leaves nothing of itself (:mod:`.isolation`), and the
    driver restarts the group when one did."""
    rank = dist.get_rank()
    said = _LastWords(sys.stderr)
    baseline = 0
    sys.stderr = said  # what the model's code prints last (argparse's message before it exits)
    try:
        baseline = release(device)
        report = RankReport(rank=rank, status=TrialStatus.OK, **_measure(request, device, baseline))
    except SystemExit as exc:  # sys.exit or argparse in the model's code: this trial's error
        report = RankReport(
            rank=rank,
            status=TrialStatus.ERROR,
            error=exit_message(exc, said.text),
            traceback=traceback.format_exc(limit=8),
            failed_at=time.time(),
        )
    except torch.OutOfMemoryError as exc:
        report = RankReport(
            rank=rank, status=TrialStatus.OOM, error=_one_line(exc), failed_at=time.time()
        )
    except Exception as exc:  # a failed trial is a result, never a crash of the group
        # a factory that called sys.exit (or argparse) on meta and on the CPU: its exit
        exited = exc.__cause__ if isinstance(exc.__cause__, SystemExit) else None
        report = RankReport(
            rank=rank,
            status=TrialStatus.ERROR,
            error=exit_message(exited, said.text) if exited else _one_line(exc),
            traceback=traceback.format_exc(limit=8),
            failed_at=time.time(),
        )
    finally:
        sys.stderr = said.stream
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    # _measure's model, optimizer and activations died with its frame (their cycles broken:
    # isolation.dismantle), and so did an exception's frames: free them now, and say what is
    # left. A model kept for the next build would be this trial's: the next builds its own.
    forget_kept_build()
    report = report.model_copy(update={"baseline": baseline, "leftover": release(device)})
    if not quiet and not report.ok:
        print(f"[autoshard rank {rank}] trial {request.n} failed: {report.error}", file=sys.stderr)
        print(report.traceback or "", file=sys.stderr, flush=True)
    return report


class _LastWords(io.TextIOBase):
    """A text stream that passes everything on and keeps the last 2,000 characters."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.text = ""

    def write(self, text: str) -> int:
        self.text = (self.text + text)[-2000:]
        return int(self.stream.write(text) or 0)

    def flush(self) -> None:
        self.stream.flush()


def _measure(request: TrialRequest, device: torch.device, baseline: int) -> dict[str, Any]:
    """Build, warm up, time and measure one trial, from ``baseline`` bytes allocated (read by
    :func:`~autoshard.trials.isolation.release` just before). The peaks reported are the
    trial's own: above the baseline on CUDA (peak statistics reset after it is read), above the
    resident set it started from on CPU. The memory cap counts the baseline too, as a GPU's
    memory does."""
    candidate, target, cap = request.candidate, request.target, request.memory_cap
    clear_peak_rss()
    baseline_rss = current_rss()
    if device.type == "cuda":
        baseline_reserved = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        if cap:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    workload = request.workload
    model: nn.Module | None = None
    try:
        model, optimizer, batch, loss_fn = build_for_training(
            target, candidate, device, workload.seq_len
        )
        autocast = autocast_for(candidate, device)
        losses: list[torch.Tensor] = []

        def step() -> None:
            # the user's loop order and accumulation: what the trial measures is what the run
            # holds
            loss = optimizer_step(
                model, optimizer, batch, workload, autocast=autocast, loss_fn=loss_fn
            )
            losses.append(loss)  # read after timing: .item() would synchronise

        for _ in range(max(1, request.warmup)):
            step()
        check_cap(peak_allocated(device, baseline, baseline_rss) + baseline, cap)

        times = time_steps(step, device, request)
        allocated = peak_allocated(device, baseline, baseline_rss)
        if device.type == "cuda":
            reserved = torch.cuda.max_memory_reserved(device) - baseline_reserved
        else:
            reserved = peak_rss()
        check_cap(allocated + baseline, cap)
        samples, tokens = step_counts(batch, workload.accumulate)
        return {
            "step_times": times,
            "allocated": int(allocated),
            "reserved": int(reserved),
            "samples": samples,
            "tokens": tokens,
            "losses": [float(v) for v in losses],
        }
    finally:
        dismantle(model)  # however the trial ended: nothing of it may outlive it


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


# ---------------------------------------------------------------------------------------------
# The process: ending with the driver, the request loop, agreeing on a trial's outcome
# ---------------------------------------------------------------------------------------------


def next_request(
    control: Path, n: int, wait: float, driver_pid: int = 0
) -> TrialRequest | StopRequest | IdleTick:
    """The driver's request ``n``; an idle tick when none came within ``wait`` seconds; a stop
    when the driver is gone. (That stop reaches every rank of every node as a clean one, before
    the watchdogs end the processes: other nodes then stop serving instead of relaunching.)"""
    path = control / f"request-{n}.json"
    deadline = time.monotonic() + wait
    while not path.exists():
        if driver_pid and not alive(driver_pid):
            return StopRequest(n=n)
        if time.monotonic() > deadline:
            return IdleTick()
        time.sleep(POLL_SECONDS)
    return parse_request(path.read_text(encoding="utf-8"))


def agree(store: Any, key: str, report: RankReport, world: int, timeout: float) -> bool:
    """Publish this rank's outcome of a trial and find out whether every rank got out of it.

    A rank that ran the trial to its end passed every collective of it, so the others did too
    (or will): it returns True at once. A rank that failed may have left the others waiting in
    a collective it will never join: it waits up to ``timeout`` for every rank's outcome and
    returns False when some never came (the group cannot go on). The outcomes go through the
    rendezvous store (``store``: a ``torch.distributed.Store``), not a collective, which a stuck
    rank could not join."""
    store.set(f"{key}/{report.rank}", report.model_dump_json())
    if report.ok:
        return True
    keys = [f"{key}/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def published_failures(store: Any, key: str, world: int) -> list[RankReport]:
    """The failed outcomes that ranks published under ``key`` (see :func:`agree`)."""
    found = []
    for r in range(world):
        if store.check([f"{key}/{r}"]):
            report = RankReport.model_validate_json(store.get(f"{key}/{r}"))
            if not report.ok:
                found.append(report)
    return found


def failure_path(control: Path, n: int, rank: int) -> Path:
    return control / f"failed-{n}-rank{rank}.json"


def abandon(control: Path, n: int, report: RankReport) -> NoReturn:
    """End this rank, and so the group, keeping the failure that the other ranks (stuck in a
    collective) cannot hear about: the driver reads it from the control folder."""
    with contextlib.suppress(OSError):
        write_json_atomically(failure_path(control, n, report.rank), report)
    print(
        f"[autoshard rank {report.rank}] trial {n} failed on this rank only ({report.error}); "
        "the other ranks wait for it in a collective: ending the worker group",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(1)  # not destroy_process_group: it would wait for the stuck ranks


def warm_model() -> tuple[nn.Module, torch.Tensor]:
    """The throwaway model of :func:`warm_up` (a target spec names it)."""
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)), torch.randn(2, 32)


WARM_TARGET = TargetSpec(spec="autoshard.trials.worker:warm_model")
# The throwaway step of warm_up_target builds the model unsharded on each rank: up to this size
# (larger models are not trialled on CPUs in practice).
WARM_TARGET_MAX_BYTES = 256 * 1024**2


def warm_up(request: TrialRequest, device: torch.device) -> None:
    """Pay this process's one-time costs of a trial before it is measured, so that they are not
    charged to it: FSDP's, autograd's and the optimizer's lazy imports and first arenas, the
    communicator's buffers (on CPU, the target's own operations' first-time costs are
    :func:`warm_up_target`'s). On CPU a trial's memory is what it adds to the process: measured
    on a tiny Llama, the first trial of a group read 134 MiB against 4 MiB for the same trial
    next. Called before the first trial of each target and engine, under that trial's deadline
    (the target's factory may hang or fail in workers: the trial then reports it)."""
    c, linear = request.candidate, "torch.nn.modules.linear.Linear"
    checkpointing = c.checkpointing is not Checkpointing.NONE
    tiny = Candidate(
        engine=c.engine,
        precision=c.precision,
        optimizer=c.optimizer,
        optimizer_impl=c.optimizer_impl,
        wrap_classes=(linear,),
        # the trial's own checkpointing code path (op-level too), on every block
        checkpointing=(
            Checkpointing.ALL if c.checkpointing is Checkpointing.EVERY_K else c.checkpointing
        ),
        checkpoint_classes=(linear,) if checkpointing else (),
    )
    # the same code path as the trial, on a model that cannot fail on one rank only
    run_trial(
        TrialRequest(
            n=request.n,
            candidate=tiny,
            target=WARM_TARGET,
            workload=WorkloadSpec(),
            warmup=0,
            steps=1,
            max_steps=1,  # one timed step: nothing is measured here
        ),
        device,
        quiet=True,
    )


def target_shape(request: TrialRequest) -> tuple[TargetSpec, Precision, int, int | None]:
    """What a CPU process's first-time costs of a target's operations depend on: the kernels'
    dtypes and shapes (oneDNN keeps a primitive per shape and dtype)."""
    c = request.candidate
    return request.target, c.precision, c.micro_batch_size, request.workload.seq_len


def warm_up_target(request: TrialRequest, device: torch.device) -> None:
    """One throwaway forward and backward of the target's model, unsharded, at the trial's
    micro-batch and precision, before the first trial of each :func:`target_shape` on CPU (the
    CUDA allocator's peak counts tensors alone). Measured on the tiny GPT: the first bf16 trial
    of a group read 51 MiB against 35.5 MiB for the same trial next, with a warm-up at
    micro-batch 1 without autocast; the first at micro-batch 1 after micro-batch 2 read 36 MiB
    against 26.7 next; with this warm-up each reads as the next one (a tiny Llama: 9 -> 4.2 MiB).
    No collective here, so a failure on one rank cannot stall the others; the trial itself
    meets it and reports it (a ``sys.exit`` too: it must not end the worker here)."""
    with contextlib.suppress(Exception, SystemExit):
        meta = build_target(request.target, device="meta").model
        if sum(p.numel() * p.element_size() for p in meta.parameters()) > WARM_TARGET_MAX_BYTES:
            return
        del meta
        torch.manual_seed(0)
        built = build_target(request.target, device="cpu")
        model = built.model
        batch = make_batch(
            model,
            built.batch,
            micro_batch_size=request.candidate.micro_batch_size,
            seq_len=request.workload.seq_len,
            device=device,
            data=built.data,
        )
        batch = with_labels(model, batch)
        loss_fn = find_loss_fn(sys.modules.get(load_callable(request.target.spec).__module__))
        with autocast_for(request.candidate, device):
            loss = compute_loss(forward(model, batch), batch, loss_fn)
        loss.backward()
    release(device)


def serve(control: Path, launch: Launch) -> NoReturn:
    """Take trial after trial until the driver asks to stop."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # No collective may wait longer than a whole trial may take: past that the driver has
    # killed the group anyway, and a rank left behind by a dead driver ends on its own. Idle
    # ranks stay within it too: rank 0 sends an idle tick every few seconds.
    on = (
        {}
        if launch.store is None
        else process_group_store(
            launch.store, f"autoshard/{control.name}", launch.collective_timeout
        )
    )  # one node: the driver's store on 127.0.0.1, not one of rank 0's on every interface
    dist.init_process_group(backend, timeout=timedelta(seconds=launch.collective_timeout), **on)
    device = rank_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        write_json_atomically(control / "ready.json", Ready(world_size=world))
    if os.environ.get("LOCAL_RANK", "0") == "0":  # this node joined a group (see group.serve)
        write_json_atomically(control / "joined.json", {"rank": rank})
    store = dist.distributed_c10d._get_default_store()
    freeze_process(device)  # the imports: again before the first trial, after its warm-ups
    tick = min(launch.idle_tick, launch.collective_timeout / 4)
    warmed: list[tuple[TargetSpec, Engine]] = []
    warmed_shapes: list[tuple[TargetSpec, Precision, int, int | None]] = []
    frozen = False  # isolation.freeze_process again, before the first trial is measured
    n = 0
    while True:
        box: list[Any] = [next_request(control, n, tick, launch.driver_pid) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        request = box[0]
        if isinstance(request, IdleTick):
            continue
        if isinstance(request, StopRequest):
            break
        if launch.warm_up and (request.target, request.candidate.engine) not in warmed:
            warm_up(request, device)
            warmed.append((request.target, request.candidate.engine))
        shape = target_shape(request)
        if launch.warm_up and device.type == "cpu" and shape not in warmed_shapes:
            warm_up_target(request, device)
            warmed_shapes.append(shape)
        if not frozen:
            freeze_process(device)
            frozen = True
        report = run_trial(request, device)
        key = f"autoshard/trial-{n}"
        everyone_out = agree(store, key, report, world, launch.agree_timeout)
        if rank == 0 and not report.ok:
            # keep every rank's failure where the driver looks, in case the group dies next
            for failed in published_failures(store, key, world):
                with contextlib.suppress(OSError):
                    write_json_atomically(failure_path(control, n, failed.rank), failed)
        if not everyone_out:
            abandon(control, n, report)
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(report, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            write_json_atomically(control / f"result-{n}.json", summarize(request, gathered))
        n += 1
    exit_worker()


def exit_worker(code: int = 0) -> NoReturn:
    """Leave the process group and end this worker process without Python's finalization.

    gloo's worker threads may still be dropping the last collective's work, which holds tensors
    owned by Python, when the interpreter finalizes: the thread then cannot take the GIL and the
    process aborts ("terminate called without an active exception", SIGABRT; 11 of 77 two-rank
    measurement runs here, 0 of 30 that ended this way; pytorch/pytorch#179291).
    destroy_process_group does not join those threads while FSDP modules or a device mesh still
    hold the group. An abort would also read as a crash to a node that takes exit code 0 as the
    stop request (:meth:`autoshard.trials.group.WorkerGroup.serve`).
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="autoshard trial worker (started by the driver)")
    parser.add_argument("--control", type=Path, required=True)
    args = parser.parse_args(argv)
    # First, before anything that may hang: never outlive torchrun or the driver.
    parent = os.getppid()
    die_with_parent()
    launch = read_message(args.control / "launch.json", Launch)
    start_watchdog(launch.driver_pid, parent)
    serve(args.control, launch)


if __name__ == "__main__":
    main()
