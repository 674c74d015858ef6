"""A trial's accounting, on the worker side: what one timed step counts, the timing of steps
(the slowest rank's time of each), the trial's own memory peak (the CUDA allocator's, or the
process's resident set on CPU) and its cap, and the ranks' reports combined into one result
(rank 0). How a trial is run is :mod:`autoshard.trials.worker`."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autoshard.measure import enough_steps, median_spread
from autoshard.results import TrialStatus
from autoshard.target.step import batch_samples, batch_tokens
from autoshard.trials.protocol import RankReport, TrialReply, TrialRequest


class CapExceededError(torch.OutOfMemoryError):
    """The measured peak passed the memory cap of a CPU trial (CPU allocations cannot be capped
    for real, so the cap is checked at step boundaries, where every rank stands together)."""


def step_counts(batch: Any, accumulate: int) -> tuple[int, int | None]:
    """(samples, tokens) of one timed step on this rank: a timed step is one optimizer step,
    every accumulated micro-batch of the whole batch (tokens None: not a token batch)."""
    return batch_samples(batch) * accumulate, (batch_tokens(batch) or 0) * accumulate or None


def time_steps(
    step: Callable[[], None], device: torch.device, request: TrialRequest
) -> list[float]:
    """Time steps until the median is known well enough (:func:`autoshard.measure.enough_steps`:
    at least ``steps``, then a spread within ``target_spread`` or the budget spent).

    Every rank records the slowest rank's time of each step (a step ends when the slowest rank
    ends it), so every rank sees the same numbers and stops after the same step: the steps'
    collectives stay matched. The all-reduce runs outside the timed region.

    On CPU the time is the process's CPU seconds (all its threads, user and system: compute,
    gloo's copies and socket work), not wall seconds: on a machine shared with other jobs a CPU
    process's wall time measures their load as much as the configuration. Measured here on 2
    busy cores (load 5-7), the same configuration's median wall time moved 2-5x between three
    repetitions (75-175 ms), its CPU time by 5% (46-49 ms)."""
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    times: list[float] = []
    while not enough_steps(
        times,
        min_steps=request.steps,
        target_spread=request.target_spread,
        max_steps=max(request.steps, request.max_steps),
        max_seconds=request.max_seconds,
    ):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([clock() - start], dtype=torch.float64)
        elapsed = elapsed.to(collective_device())
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed.item()))
    return times


def peak_allocated(device: torch.device, baseline: int, baseline_rss: int) -> int:
    """The trial's own peak: on CUDA the allocator's peak above the ``baseline`` it started
    from; on CPU what the trial added to the process at its peak (model, optimizer state,
    activations) above the resident set ``baseline_rss`` it started from."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return max(0, int(torch.cuda.max_memory_allocated(device)) - baseline)
    return max(0, peak_rss() - baseline_rss)


def check_cap(allocated: int, cap: int | None) -> None:
    # Every rank decides together: one rank over the cap fails the trial for all, at a point
    # where no collective is in flight.
    over = torch.tensor([1 if cap and allocated > cap else 0], dtype=torch.int64)
    dist.all_reduce(over.to(collective_device()), op=dist.ReduceOp.MAX)
    if over.item():
        raise CapExceededError(
            f"peak {allocated / 2**20:.1f} MiB on this rank exceeds the memory cap "
            f"{(cap or 0) / 2**20:.1f} MiB"
        )


def collective_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else (torch.device("cpu"))
    )


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


def summarize(request: TrialRequest, per_rank: list[RankReport]) -> TrialReply:
    """Combine the ranks' measurements into one result (rank 0)."""
    world = len(per_rank)
    levels = {
        "baseline_bytes": tuple(r.baseline for r in per_rank),
        "leftover_bytes": tuple(r.leftover for r in per_rank),
    }
    for status in (TrialStatus.OOM, TrialStatus.ERROR):
        failed = [r for r in per_rank if r.status is status]
        if failed:
            # the first to fail is the cause; the others may have failed because of it
            first = min(failed, key=lambda r: (r.failed_at or 0.0, r.rank))
            # the model's own error is deterministic: every rank raises it (one rank alone, the
            # others failing on the broken collective, is that rank's data or node)
            same = sum(1 for r in failed if r.error == first.error)
            return TrialReply(
                n=request.n,
                status=status,
                world_size=world,
                error=f"rank {first.rank}: {first.error}",
                raised_on=same if status is TrialStatus.ERROR else None,
                traceback=first.traceback,
                **levels,
            )
    # A step ends when the slowest rank ends it: take the per-step maximum over ranks.
    steps = [max(ts) for ts in zip(*(r.step_times for r in per_rank), strict=True)]
    median = statistics.median(steps)
    spread = median_spread(steps)
    samples = sum(r.samples for r in per_rank)
    tokens = per_rank[0].tokens
    diverged = first_non_finite(per_rank)
    return TrialReply(
        n=request.n,
        status=TrialStatus.OK if diverged is None else TrialStatus.DIVERGED,
        error=diverged,
        world_size=world,
        step_times=tuple(steps),
        step_time=median,
        step_time_spread=spread,
        samples_per_s=samples / median,
        tokens_per_s=(tokens * world / median) if tokens else None,
        peak_allocated=tuple(r.allocated for r in per_rank),
        peak_reserved=tuple(r.reserved for r in per_rank),
        losses=per_rank[0].losses,
        **levels,
    )


def first_non_finite(per_rank: list[RankReport]) -> str | None:
    """'loss nan at step 3 of 5 (rank 0)' for the earliest step at which a rank's loss was
    NaN or infinite (warm-up steps count); None when every loss is finite. Such a trial ran
    every step: its times are kept, but it trained nothing."""
    found = [
        (step, r.rank, value)
        for r in per_rank
        for step, value in enumerate(r.losses, 1)
        if not math.isfinite(value)
    ]
    if not found:
        return None
    step, rank, value = min(found, key=lambda f: (f[0], f[1]))
    steps = max(len(r.losses) for r in per_rank)
    return f"loss {value} at step {step} of {steps} (rank {rank})"
