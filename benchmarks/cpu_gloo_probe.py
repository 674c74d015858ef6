"""Measure the placeholder speeds of the ``cpu-gloo`` catalogue entry on this machine.

autoshard's CPU trials run one process per rank, one thread each, talking over gloo. This
prints what such a process computes (matmul FLOP/s per dtype), copies (memcpy bytes/s) and
receives in an all-gather with 2 ranks. The numbers in ``autoshard.gpus.CATALOGUE["cpu-gloo"]``
come from one run of it (benchmarks/results/cpu_gloo_probe.txt); the speed model calibrates them
with trials.

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
    shard = torch.randn(4 * 2**20)  # 16 MiB per rank
    out = torch.empty(shard.numel() * world)
    dist.all_gather_into_tensor(out, shard)
    reps = 5
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_gather_into_tensor(out, shard)
    seconds = (time.perf_counter() - start) / reps
    if rank == 0:
        received = shard.numel() * shard.element_size() * (world - 1)
        print(f"gloo all-gather, {world} ranks: {received / seconds / 1e9:.2f} GB/s received/rank")
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        print(f"matmul {dtype!s:15s} {matmul_flops(dtype, reps=3) / 1e9:8.0f} GFLOP/s")
    print(f"memcpy {copy_bandwidth() / 1e9:.1f} GB/s")
    mp.spawn(_all_gather, args=(2, 29611), nprocs=2)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    main()
