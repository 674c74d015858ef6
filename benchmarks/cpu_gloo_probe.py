"""Measure the placeholder speeds of the ``cpu-gloo`` catalogue entry on this machine.

autoshard's CPU trials run one process per rank, one thread each, talking over gloo. This
prints what such a process computes (matmul FLOP/s per dtype), copies (memcpy bytes/s), writes
into freshly mapped pages, receives in an all-gather with 2 ranks (into a reused output, and
into a fresh one as FSDP gathers), and what one FSDP1 unit costs a step in CPU seconds beyond
its compute (the slope of a step's CPU time over the number of units of a stack of small Linear
layers, each its own unit: hooks, flat-parameter views, the gloo calls and their copies). The
numbers in ``autoshard.gpus.CATALOGUE["cpu-gloo"]``
and the cpu-gloo factors (``autoshard.predict.speed.default_factors``) come from runs of it
(benchmarks/results/cpu_gloo_probe.txt); the speed model calibrates them with trials.

    python benchmarks/cpu_gloo_probe.py
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def matmul_flops(dtype: torch.dtype, n: int = 1024, reps: int = 5) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start)


def copy_bandwidth(nbytes: int = 64 * 2**20, reps: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return nbytes * reps / (time.perf_counter() - start)


def _all_gather(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for mib in (2, 8):
        shard = torch.randn(mib * 2**20 // 4)
        reused = torch.empty(shard.numel() * world)
        dist.all_gather_into_tensor(reused, shard)
        for fresh in (False, True):
            reps = 10
            # CPU seconds, as CPU trials time their steps. A fresh output each time is what FSDP
            # does (each unit's unsharded parameters are a new tensor): with the workers' fixed
            # mmap threshold, a new mapping whose pages fault in as gloo writes them.
            start = time.process_time()
            for _ in range(reps):
                out = torch.empty(shard.numel() * world) if fresh else reused
                dist.all_gather_into_tensor(out, shard)
            seconds = torch.tensor([(time.process_time() - start) / reps])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if rank == 0:
                received = shard.numel() * shard.element_size() * (world - 1)
                print(
                    f"gloo all-gather of {mib} MiB shards, {world} ranks, "
                    f"{'fresh' if fresh else 'reused'} output: "
                    f"{received / seconds.item() / 1e9:.2f} GB/s received/rank (CPU seconds)"
                )
    dist.destroy_process_group()


def _fsdp_unit_cost(rank: int, world: int, port: int) -> None:
    """CPU ms per step of an FSDP1 unit (per sharding), from stacks of 2 and 10 Linear(64, 64)
    units at batch 1 (their compute is microseconds): the cost the speed model's
    ``collective_latency_s`` stands for on CPU processes, per collective."""
    import statistics

    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # collectives per unit and step: FULL_SHARD gathers in forward and backward and
    # reduce-scatters; SHARD_GRAD_OP gathers once; NO_SHARD all-reduces
    for sharding, collectives in (("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2), ("NO_SHARD", 1)):
        per_step = {}
        for units in (2, 10):
            torch.manual_seed(0)
            model = FullyShardedDataParallel(
                nn.Sequential(*[nn.Linear(64, 64) for _ in range(units)]),
                sharding_strategy=ShardingStrategy[sharding],
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                device_id=torch.device("cpu"),
                use_orig_params=True,
            )
            optimizer = torch.optim.AdamW(model.parameters())
            x = torch.randn(1, 64)
            times = []
            for _ in range(40):
                start = time.process_time()
                model(x).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                times.append(time.process_time() - start)
            slowest = torch.tensor([statistics.median(times[5:])])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            per_step[units] = slowest.item()
            del model, optimizer
        unit = (per_step[10] - per_step[2]) / 8
        if rank == 0:
            print(
                f"FSDP1 unit, {world} ranks, {sharding}: {unit * 1e3:.2f} CPU ms per step "
                f"({unit / collectives * 1e3:.2f} per collective)"
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        print(f"matmul {dtype!s:15s} {matmul_flops(dtype, reps=3) / 1e9:8.0f} GFLOP/s")
    print(f"memcpy {copy_bandwidth() / 1e9:.1f} GB/s")
    # the rate the step-time model uses, probed as it probes it at run time
    from autoshard.predict.hardware import measured_cpu

    fresh = measured_cpu().fresh_page_bandwidth or 0.0
    print(f"fresh pages (mmap, then written) {fresh / 1e9:.1f} GB/s")
    # The ranks run as autoshard's CPU trial workers do (autoshard.trials.group: their resident
    # set measures live tensors with glibc's mmap threshold fixed at 128 KiB).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    mp.spawn(_all_gather, args=(2, 29611), nprocs=2)
    mp.spawn(_fsdp_unit_cost, args=(2, 29612), nprocs=2)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    main()
