"""The worker side of a trial: run inside a process group started by ``torch.distributed.run``.

``python -m torch.distributed.run ... -m autoshard.trials.worker --control DIR`` starts one of
these per rank. They stay up for a whole study: rank 0 waits for ``DIR/request-N.json``,
broadcasts it, every
rank runs the trial (build, shard, warm up, time, measure), and rank 0 writes
``DIR/result-N.json``. A trial that fails the same way on every rank (an OOM, a bad config) is
recorded and the workers go on; a rank that dies or hangs is the driver's to handle
(:mod:`autoshard.group` kills and restarts the group).

Memory: on CUDA the allocator's ``max_memory_allocated`` / ``max_memory_reserved`` over the whole
trial. On CPU, the process memory: "allocated" is how far the trial raised the process's peak
resident set above where it started (model, optimizer state, activations, buffers), "reserved" the
peak resident set itself. (torch's ``MemTracker`` would count tensors exactly, but it cannot follow
FSDP1's parameter views: "post accumulate grad hooks cannot be registered on non-leaf tensors".)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from autoshard.config import Candidate, Engine, Loop, Precision, WorkloadSpec
from autoshard.loop import autocast_for, optimizer_step
from autoshard.results import TrialStatus
from autoshard.sharding import apply_fsdp1, apply_fsdp2, fsdp2_mesh, make_optimizer
from autoshard.target.resolve import TargetSpec, build_target, load_callable
from autoshard.target.step import (
    batch_samples,
    batch_tokens,
    find_loss_fn,
    make_batch,
    with_labels,
)

# Models up to this size are built for real on the CPU (exact initialisation, computed buffers
# kept); larger ones are built on meta and materialised shard by shard by FSDP.
REAL_BUILD_MAX_BYTES = 2 * 1024**3
POLL_SECONDS = 0.05


class CapExceededError(torch.OutOfMemoryError):
    """The measured peak passed the memory cap of a CPU trial (CPU allocations cannot be capped
    for real, so the cap is checked at step boundaries, where every rank stands together)."""


def rank_device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


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
    model, built_batch = build_sharded(target, candidate, device)
    optimizer = make_optimizer(model.parameters(), candidate)
    batch = make_batch(
        model,
        built_batch,
        micro_batch_size=candidate.micro_batch_size,
        seq_len=seq_len,
        device=device,
    )
    batch = with_labels(model, batch)
    loss_fn = find_loss_fn(sys.modules.get(load_callable(target.spec).__module__))
    return model, optimizer, batch, loss_fn


def build_sharded(
    target: TargetSpec, candidate: Candidate, device: torch.device
) -> tuple[nn.Module, Any]:
    """Build the target's model on this rank and apply the candidate to it."""
    built = build_target(target, device="meta")
    param_bytes = sum(p.numel() * p.element_size() for p in built.model.parameters())
    real = param_bytes <= REAL_BUILD_MAX_BYTES
    if real:
        torch.manual_seed(0)
        built = build_target(target, device="cpu")
    model, batch = built.model, built.batch
    if batch is not None and not real:
        batch = None  # a batch built on meta holds no data: synthesise one instead
    if candidate.precision is Precision.BF16_TRUE:
        model = model.to(torch.bfloat16)
    if candidate.engine is Engine.FSDP1:
        init = None if real else (lambda m: init_states(m, device))
        model = apply_fsdp1(model, candidate, device, param_init_fn=init)
    else:
        mesh = fsdp2_mesh(candidate, device, dist.get_world_size())
        model = apply_fsdp2(model, candidate, mesh)
        if not real:
            model.to_empty(device=device)
            for module in model.modules():
                init_states(module, device)
        elif device.type != "cpu":
            model.to(device)
    return model, batch


def run_trial(request: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Run one trial on this rank; return its local measurements (never raises)."""
    out: dict[str, Any] = {"status": TrialStatus.OK.value, "rank": dist.get_rank()}
    try:
        out.update(_measure(request, device))
    except torch.OutOfMemoryError as exc:
        out.update(status=TrialStatus.OOM.value, error=_one_line(exc))
    except Exception as exc:  # a failed trial is a result, never a crash of the group
        out.update(status=TrialStatus.ERROR.value, error=_one_line(exc))
        out["traceback"] = traceback.format_exc(limit=8)
    finally:
        # _measure's model, optimizer and activations died with its frame: release them now.
        release_freed_memory()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    return out


def _measure(request: dict[str, Any], device: torch.device) -> dict[str, Any]:
    candidate = Candidate.model_validate(request["candidate"])
    target = TargetSpec.model_validate(request["target"])
    cap = request.get("memory_cap")
    release_freed_memory()
    clear_peak_rss()
    baseline = current_rss()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        if cap:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    workload = workload_of(request)
    model, optimizer, batch, loss_fn = build_for_training(
        target, candidate, device, workload.seq_len
    )
    autocast = autocast_for(candidate, device)

    losses: list[torch.Tensor] = []

    def step() -> None:
        # the user's loop order and accumulation: what the trial measures is what the run holds
        loss = optimizer_step(model, optimizer, batch, workload, autocast=autocast, loss_fn=loss_fn)
        losses.append(loss)  # read after timing: .item() would synchronise

    for _ in range(max(1, request["warmup"])):
        step()
    _check_cap(_peak_allocated(device, baseline), cap)

    times = []
    for _ in range(request["steps"]):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    allocated = _peak_allocated(device, baseline)
    reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else peak_rss()
    _check_cap(allocated, cap)
    return {
        "step_times": times,
        "allocated": int(allocated),
        "reserved": int(reserved),
        # a timed step is one optimizer step: every accumulated micro-batch
        "samples": batch_samples(batch) * workload.accumulate,
        "tokens": (batch_tokens(batch) or 0) * workload.accumulate or None,
        "losses": [float(v) for v in losses],
    }


def _peak_allocated(device: torch.device, baseline: int) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    # CPU: what the trial added to the process at its peak (model, optimizer state, activations)
    return max(0, peak_rss() - baseline)


def _check_cap(allocated: int, cap: int | None) -> None:
    # Every rank decides together: one rank over the cap fails the trial for all, at a point
    # where no collective is in flight.
    over = torch.tensor([1 if cap and allocated > cap else 0], dtype=torch.int64)
    dist.all_reduce(over.to(_collective_device()), op=dist.ReduceOp.MAX)
    if over.item():
        raise CapExceededError(
            f"peak {allocated / 2**20:.1f} MiB on this rank exceeds the memory cap "
            f"{(cap or 0) / 2**20:.1f} MiB"
        )


def _collective_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else (torch.device("cpu"))
    )


def workload_of(request: dict[str, Any]) -> WorkloadSpec:
    """The workload a trial request asks for (a request without a loop: the Trainer's)."""
    return WorkloadSpec(
        seq_len=request.get("seq_len"),
        loop=request.get("loop", Loop.LIGHTNING.value),
        accumulate=request.get("accumulate", 1),
    )


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so that
    the resident set measures live memory and one trial's leftovers do not hide the next one's
    growth."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def clear_peak_rss() -> None:
    """Reset the process's peak resident set (Linux: writing 5 to clear_refs)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss() -> int:
    """Peak resident set of this process in bytes (VmHWM), 0 where unknown."""
    return _status_bytes("VmHWM:")


def current_rss() -> int:
    """Resident set of this process in bytes (VmRSS), 0 where unknown."""
    return _status_bytes("VmRSS:")


def summarize(request: dict[str, Any], per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine the ranks' measurements into one result (rank 0)."""
    statuses = [r["status"] for r in per_rank]
    world = len(per_rank)
    result: dict[str, Any] = {"n": request["n"], "world_size": world}
    for status in (TrialStatus.OOM.value, TrialStatus.ERROR.value):
        if status in statuses:
            failed = next(r for r in per_rank if r["status"] == status)
            result.update(status=status, error=f"rank {failed['rank']}: {failed.get('error')}")
            result["traceback"] = failed.get("traceback")
            return result
    # A step ends when the slowest rank ends it: take the per-step maximum over ranks.
    steps = [max(ts) for ts in zip(*(r["step_times"] for r in per_rank), strict=True)]
    median = statistics.median(steps)
    samples = sum(r["samples"] for r in per_rank)
    tokens = per_rank[0]["tokens"]
    result.update(
        status=TrialStatus.OK.value,
        step_times=steps,
        step_time=median,
        samples_per_s=samples / median,
        tokens_per_s=(tokens * world / median) if tokens else None,
        peak_allocated=[r["allocated"] for r in per_rank],
        peak_reserved=[r["reserved"] for r in per_rank],
        losses=per_rank[0]["losses"],
    )
    return result


def wait_for_request(control: Path, n: int) -> dict[str, Any]:
    """The driver's next request; a stop request if the driver died (killed, Ctrl-C), so that
    no orphaned workers are left behind."""
    path = control / f"request-{n}.json"
    driver = int(os.environ.get("AUTOSHARD_DRIVER_PID", "0"))
    while not path.exists():
        if driver and not _alive(driver):
            return {"stop": True}
        time.sleep(POLL_SECONDS)
    return dict(json.loads(path.read_text()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_json_atomically(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def serve(control: Path) -> None:
    """Take trial after trial until the driver asks to stop."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # Idle ranks wait in a broadcast while rank 0 waits for the next request: a long timeout.
    dist.init_process_group(backend, timeout=timedelta(hours=12))
    device = rank_device()
    rank = dist.get_rank()
    if rank == 0:
        write_json_atomically(control / "ready.json", {"world_size": dist.get_world_size()})
    n = 0
    while True:
        box: list[Any] = [wait_for_request(control, n) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        request = box[0]
        if request.get("stop"):
            break
        local = run_trial(request, device)
        gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
        dist.gather_object(local, gathered if rank == 0 else None, dst=0)
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
    serve(args.control)


if __name__ == "__main__":
    main()
