"""The hardware a step-time prediction is made for: the catalogue entry of the planned GPUs
(:func:`speed_for`), the visible CUDA GPU (:func:`detected_gpu`), and this CPU's speeds measured
for CPU worker processes (:func:`measured_cpu`): matrix products, memory copies, issuing small
operations, and writing freshly mapped pages."""

from __future__ import annotations

import functools
import math
import mmap
import os
import time

import torch

from autoshard.config import Hardware, Precision
from autoshard.gpus import CATALOGUE, DEFAULT_GPU, GPUSpec, gpu_spec, match_gpu_name


def speed_for(hardware: Hardware) -> tuple[GPUSpec, str]:
    """The catalogue entry to predict ``hardware``'s speed with, its bandwidths overridden as
    the hardware says, and a note when the entry was assumed rather than given.

    CPU processes (``backend="gloo"``) get the ``cpu-gloo`` entry with this machine's FLOP/s
    and memory bandwidth measured once (a few milliseconds, cached).

    >>> from autoshard import Hardware
    >>> from autoshard.predict.hardware import speed_for
    >>> gpu, note = speed_for(Hardware(gpu_memory=80 * 2**30, gpu="a100-80gb-sxm",
    ...                                inter_node_bandwidth=100e9))
    >>> gpu.id, gpu.inter_node_bandwidth / 1e9, note
    ('a100-80gb-sxm', 100.0, '')
    >>> speed_for(Hardware(gpu_memory=80 * 2**30))[1][:40]
    'no GPU given: speeds assumed for h100-sx'
    """
    note = ""
    if hardware.gpu is not None:
        gpu = gpu_spec(hardware.gpu)
        if gpu.id == "cpu-gloo":
            gpu = measured_cpu(hardware.gpus_per_node)
    elif hardware.backend == "gloo":
        gpu = measured_cpu(hardware.gpus_per_node)
    else:
        gpu = CATALOGUE[DEFAULT_GPU]
        note = (
            f"no GPU given: speeds assumed for {gpu.id} ({gpu.name}); give --gpu (gpu= in code) "
            "for yours"
        )
    updates = {}
    if hardware.intra_node_bandwidth is not None:
        updates["intra_node_bandwidth"] = hardware.intra_node_bandwidth
    if hardware.inter_node_bandwidth is not None:
        updates["inter_node_bandwidth"] = hardware.inter_node_bandwidth
    return (gpu.model_copy(update=updates) if updates else gpu), note


def detected_gpu() -> str | None:
    """The catalogue id of the visible CUDA GPU, or None (no GPU, or one not catalogued): for
    the command line and ``detect_hardware`` to fill ``Hardware.gpu``."""
    if not torch.cuda.is_available():
        return None
    return match_gpu_name(torch.cuda.get_device_name())


def measured_cpu(ranks: int = 1) -> GPUSpec:
    """The ``cpu-gloo`` entry with this CPU's speeds, as one of ``ranks`` one-thread processes
    sharing the machine's cores sees them (more ranks than cores share them)."""
    flops32, flops16, bandwidth, _, fresh = measure_cpu()
    # A bf16-autocast step casts every weight and activation, so a CPU's faster bf16 products
    # do not make its step faster: bf16 is given no more than the fp32 rate (measured:
    # benchmarks/results/measured_constants.md, "bf16 on CPU processes").
    flops16 = min(flops16, flops32)
    share = min(1.0, (os.cpu_count() or 1) / max(ranks, 1))
    return CATALOGUE["cpu-gloo"].model_copy(
        update={
            "name": f"CPU worker processes (gloo), {share:.2g} core each, measured",
            "fp32_flops": flops32 * share,
            "tf32_flops": flops32 * share,
            "bf16_flops": flops16 * share,
            "fp16_flops": flops16 * share,
            "hbm_bandwidth": bandwidth * share,
            "host_link_bandwidth": bandwidth * share,
            "fresh_page_bandwidth": fresh * share,
        }
    )


@functools.cache
def measure_cpu() -> tuple[float, float, float, float, float]:
    """(fp32 matmul FLOP/s, bf16 matmul FLOP/s, copy bytes/s, seconds to issue one small
    operation, bytes/s written into freshly mapped pages) of one thread, as the trial workers
    run (OMP_NUM_THREADS=1). The best of a few repeats: other processes only slow it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def rate(fn: object, work: float, repeats: int = 5) -> float:
            # This thread's CPU seconds, as CPU trials time their steps: in wall seconds the
            # machine's other jobs set the rates (a 32 MiB copy at 2.4 GB/s at load 8 on 2
            # cores, 54 GB/s idle), and every prediction for CPU processes with them.
            best = math.inf
            for _ in range(repeats):
                start = time.thread_time()
                fn()  # type: ignore[operator]
                best = min(best, time.thread_time() - start)
            return work / max(best, 1e-9)

        n = 256
        a32, b32 = torch.randn(n, n), torch.randn(n, n)
        a16, b16 = a32.bfloat16(), b32.bfloat16()
        src = torch.empty(32 * 2**20, dtype=torch.uint8)  # beyond the caches
        dst = torch.empty_like(src)
        one = torch.ones(1)

        def small_ops() -> None:
            for _ in range(200):
                one.add(one)

        def fresh_pages() -> None:
            # what a tensor above a fixed mmap threshold costs: a new mapping, written
            pages = mmap.mmap(-1, src.numel())
            torch.frombuffer(pages, dtype=torch.uint8).fill_(1)

        return (
            rate(lambda: torch.mm(a32, b32), 2 * n**3),
            rate(lambda: torch.mm(a16, b16), 2 * n**3),
            rate(lambda: dst.copy_(src), 2 * src.numel()),  # read and write
            1 / rate(small_ops, 200),
            rate(fresh_pages, src.numel()),
        )
    finally:
        torch.set_num_threads(threads)


def dense_flops(gpu: GPUSpec, precision: Precision, *, tf32: bool = False) -> float:
    """The dense peak FLOP/s the candidate's matrix products run at: bf16 or fp16 tensor cores
    for 16-bit compute; for ``32-true`` the fp32 rate, or TF32 tensor cores with ``tf32=True``
    (``torch.set_float32_matmul_precision("high")``)."""
    match precision:
        case Precision.BF16_MIXED | Precision.BF16_TRUE:
            return gpu.bf16_flops
        case Precision.FP16_MIXED:
            return gpu.fp16_flops
        case Precision.FP32:
            return gpu.tf32_flops if tf32 else gpu.fp32_flops
        case _:
            raise ValueError(f"unknown precision {precision!r}")
