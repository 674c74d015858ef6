"""How much of each hardware peak a training step reaches (:class:`SpeedFactors`), and the
uncalibrated factors for a GPU or for CPU processes: what trials calibrate
(:mod:`autoshard.predict.calibrate`) and the step-time model (:mod:`autoshard.predict.speed`)
multiplies by."""

from __future__ import annotations

from pydantic import Field

from autoshard.config import Frozen
from autoshard.gpus import GPUSpec
from autoshard.predict.hardware import measure_cpu


class SpeedFactors(Frozen):
    """How much of each hardware peak a training step reaches: what trials calibrate.

    The defaults are one set for every GPU, from public measurements (not fitted to the
    benchmark that checks them, ``benchmarks/step_time_published.py``).

    >>> from autoshard.predict.speed import SpeedFactors
    >>> SpeedFactors().compute_efficiency
    0.7
    """

    compute_efficiency: float = Field(
        0.7,
        gt=0,
        le=1,
        description="Achieved / achievable FLOP/s of the counted FLOPs: the share of the GPU's "
        "best matrix-product rate (``GPUSpec.matmul_fraction`` of its peak) and of its fused "
        "attention rate (``attention_fraction``) that a training step's kernels reach (their "
        "shapes are not the best ones; gaps between kernels). Default: large-model training "
        "on A100s reaches 52-72% of the 312 TFLOP/s peak (Megatron-LM, Narayanan et al. 2021: "
        "52%; Korthikanti et al. 2022: 54-56%; FlashAttention-2's GPT training: 72%), which is "
        "0.6-0.83 of the A100's achievable 271 TFLOP/s; 0.7 is the middle. Not fitted to the "
        "benchmark that checks it (benchmarks/step_time_published.py, whose results show the "
        "sensitivity).",
    )
    comm_efficiency: float = Field(
        0.75,
        gt=0,
        le=1,
        description="Achieved / link bandwidth of a collective. Default: NCCL's all-gather and "
        "reduce-scatter bus bandwidth reach about 80% of NVLink (nccl-tests on 8 H100 SXM: ~360 "
        "of 450 GB/s) and about 90% of InfiniBand at large messages; FSDP's per-unit messages "
        "run beside compute that shares the GPU, so a little less.",
    )
    collective_latency_s: float = Field(
        30e-6,
        ge=0,
        description="Fixed cost of one collective (launch, synchronisation), seconds. NCCL's "
        "small-message latency is 10-50 us inside a node and grows slowly with the number of "
        "nodes (tree and PAT algorithms); one number for all.",
    )
    memory_efficiency: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Achieved / peak device-memory bandwidth of the memory-bound work (the "
        "model's element-wise operations and the optimizer step): large element-wise kernels "
        "reach 80-90% of HBM bandwidth.",
    )
    host_efficiency: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Achieved / peak host-link bandwidth of CPU offload's copies (pinned "
        "copies reach ~25 of PCIe Gen4's 32 GB/s).",
    )
    host_memory_bandwidth: float = Field(
        100e9,
        gt=0,
        description="Bytes/s of host memory that the ranks of one node stream through in their "
        "CPU optimizer steps. Default: 8 ranks of one thread each (torchrun's OMP_NUM_THREADS=1) "
        "at the ~13 GB/s one core copies (measured on this project's Xeon VM); a dual-socket "
        "server's DRAM peaks at 400-600 GB/s.",
    )
    host_thread_bandwidth: float = Field(
        13e9,
        gt=0,
        description="Bytes/s one rank's CPU optimizer step streams on its own: one thread "
        "(torchrun's OMP_NUM_THREADS=1) at the ~13 GB/s one core copies (measured on this "
        "project's Xeon VM). With fewer ranks than the node's memory could feed, each is bound "
        "by its thread, not by its share of ``host_memory_bandwidth``.",
    )
    op_overhead_s: float = Field(
        14e-6,
        ge=0,
        description="Host seconds to issue one operation (Python, dispatcher, autograd, kernel "
        "launch). A GPU runs the kernels meanwhile, so this bounds a small model's step from "
        "below (:mod:`autoshard.predict.host_bound`); CPU processes pay it on top of the work "
        "(measured at run time for cpu-gloo). Default: an eager forward and backward at width "
        "16, where the kernels' arithmetic is negligible, took 9.2 (Llama-style decoder) and "
        "12.7 (Lightning's demo Transformer) CPU us per counted kernel on this project's Xeon "
        "VM (benchmarks/results/host_overhead_probe.txt, the least of three runs), plus the "
        "driver's launch, 'cuLaunchKernel (raw CUDA driver) 3.0us' (meta-pytorch/tritonbench "
        "PR #1017): 11 + 3.",
    )
    unit_host_scale: float = Field(
        1.0,
        ge=0,
        description="Times the host seconds FSDP's hooks cost each unit of a step "
        "(:data:`autoshard.predict.host_bound.FSDP_UNIT_HOST_S`, measured on this project's "
        "Xeon VM: 1.6-3.0 ms per unit, by engine and sharding); a faster or slower host scales "
        "them; 0 leaves them out. Not applied to CPU processes (their ``collective_latency_s`` "
        "is FSDP's cost per unit).",
    )
    overlap_slowdown: float = Field(
        0.189,
        ge=0,
        le=1,
        description="How much slower compute runs while a collective runs beside it (0.189: "
        "19% longer). Default: 'an average computational slowdown of 18.9%, with a maximum of "
        "40.0%' when computation overlaps communication, measured on A100, H100, MI250 and "
        "MI210 with GPT and LLaMA models (Lee et al. 2025, 'Characterizing Compute-Communication "
        "Overlap in GPU-Accelerated Distributed Deep Learning', arXiv:2507.03114). Applies only "
        "where collectives overlap compute (``overlap``).",
    )
    pressure_margin: float = Field(
        0.05,
        ge=0,
        lt=1,
        description="Share of the usable GPU memory below which a predicted peak counts as near "
        "the limit: there the caching allocator runs out of free cached blocks, frees them all "
        "and retries cudaMalloc, synchronising the device (torch.cuda.memory_stats: "
        "'num_alloc_retries: number of failed cudaMalloc calls that result in a cache flush and "
        "retry'). 5%: the default margin the planner already keeps (Hardware.margin).",
    )
    pressure_slowdown: float = Field(
        0.1,
        ge=0,
        description="How much slower a step runs at the limit, rising linearly from 0 at "
        "``pressure_margin`` below it. Measured at the limit: Mistral 7B with FSDP FULL_SHARD "
        "at 4,600 tokens ran 6.52, 6.83 and 4.91 samples/s at micro-batches 10, 12 and 14, "
        "'CUDA MALLOC RETRIES goes up and creates bottlenecks' (foundation-model-stack/fms-fsdp "
        "issue #63): 28% lost at the last size that fit. 10%, not 28%: the memory estimate's "
        "own error near the limit is larger than the margin (benchmarks/results/"
        "step_time_published.md), so a flagged candidate is often not at the limit.",
    )
    overlap: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Fraction of the communication that may hide behind compute: 1 for NCCL "
        "(its own CUDA streams), 0 where collectives block the compute (gloo on CPU processes).",
    )


DEFAULT_FACTORS = SpeedFactors()

# How much slower a GPU server's host issues a step than the constants measured on this
# project's VM (op_overhead_s, host_bound's per-unit and per-recipe costs) say: fitted on the
# host-bound rows of the fitting set of autoshard's H200 measurements, the one GPU host
# measured (benchmarks/results/measured_constants.md). Trials calibrate both factors there.
GPU_HOST_SCALE = 1.4


def default_factors(gpu: GPUSpec) -> SpeedFactors:
    """The uncalibrated factors for ``gpu``: one set for every GPU but its compute efficiency
    (the catalogue's ``step_efficiency``: A100 0.75, H100/H200 0.6), another for CPU processes
    (gloo), where FSDP waits for each collective on the calling thread (no side stream), so
    nothing overlaps, and issuing an operation costs what was measured here. The trials
    calibrate the rest."""
    if not gpu.host_is_device:
        # the GPU's own share of its achievable rate (catalogue: A100 0.75, H100/H200 0.6), and
        # a GPU server's host
        return DEFAULT_FACTORS.model_copy(
            update={
                "compute_efficiency": gpu.step_efficiency,
                "op_overhead_s": DEFAULT_FACTORS.op_overhead_s * GPU_HOST_SCALE,
                "unit_host_scale": DEFAULT_FACTORS.unit_host_scale * GPU_HOST_SCALE,
            }
        )
    # measured here, profiled and against the CPU trials (benchmarks/results/
    # measured_constants.md, "CPU processes' factors")
    return SpeedFactors(
        compute_efficiency=0.7,
        memory_efficiency=0.25,
        collective_latency_s=8e-4,
        overlap=0.0,
        op_overhead_s=measure_cpu()[3],
    )
