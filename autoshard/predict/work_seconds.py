"""Seconds of the pieces of one micro-batch's work at a candidate's rates (FLOPs, fused
attention, memory traffic, fresh pages, launches): per block and for the rest of the model, the
step-time model's inputs (:mod:`autoshard.predict.speed`). Candidates of the same FLOPs and
rates share them, so they are computed once (:func:`piece_seconds`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from autoshard.config import Candidate, Precision
from autoshard.engine import element_bytes
from autoshard.gpus import GPUSpec
from autoshard.predict.factors import SpeedFactors
from autoshard.predict.flops import FlopProfile

# Host seconds per kernel under autocast (bf16-mixed, 16-mixed) over its op_overhead_s: every
# operation passes autocast's dispatch key (a dtype check, a cast where an input is fp32);
# measured: benchmarks/results/measured_constants.md, "Host costs of a step on one rank".
AUTOCAST_HOST_RATIO = 1.38


def op_host_seconds(candidate: Candidate, op_s: float) -> float:
    """Host seconds to issue one kernel of ``candidate``'s step: ``op_s``, under autocast
    :data:`AUTOCAST_HOST_RATIO` times it."""
    return op_s * AUTOCAST_HOST_RATIO if candidate.precision.mixed else op_s


@dataclass(frozen=True)
class WorkRates:
    """Seconds of a piece of one micro-batch's work on the device: its matrix-product FLOPs (per
    profiled sample) over the matrix rate, its fused-attention FLOPs over the attention rate,
    its memory traffic over the memory rate, the new tensors it writes over the rate of fresh
    pages (where memory is not reused: CPU trial processes), and launching its operations. A
    GPU runs the kernels while the host launches the next ones, so the piece takes the longer
    of the two (a small model is launch-bound); a CPU does both in turn. Frozen: the key of the
    seconds candidates at the same rates share (:func:`piece_seconds`)."""

    flop_s: float
    attention_s: float
    byte_s: float
    op_s: float
    host_is_device: bool
    fresh_s: float | None = None

    def seconds(
        self, flops: float, attention: float, traffic: float, ops: float, fresh: float = 0.0
    ) -> float:
        """``attention``: the part of ``flops`` that is fused attention."""
        device = (
            (flops - attention) / self.flop_s + attention / self.attention_s + traffic / self.byte_s
        )
        if self.fresh_s:
            device += fresh / self.fresh_s
        host = ops * self.op_s
        return device + host if self.host_is_device else max(device, host)


def _pass_seconds(flops: FlopProfile, part: str, work: WorkRates) -> list[float]:
    """Seconds of each profiled block's ``part`` (forward or backward) in one micro-batch."""
    parts = (flops.block_parts(part, what) for what in ("attention", "traffic", "ops", "fresh"))
    return [
        work.seconds(*piece) for piece in zip(getattr(flops, f"block_{part}"), *parts, strict=True)
    ]


def per_analysed_block(profiled: Sequence[float], count: int) -> tuple[float, ...]:
    """Each of the ``count`` analysed (wrapped) blocks' share of ``profiled``, what the FLOP
    profile counted per block it ran: its own value where the profile found the same blocks,
    else the blocks' total spread evenly over ``count``, or one piece where the analysis wraps
    no block. The one rule for seconds (:func:`piece_seconds`) and kernels
    (:mod:`autoshard.predict.host_bound`), so the two never split the blocks differently."""
    if len(profiled) == count:
        return tuple(profiled)
    if count == 0:  # blocks the analysis does not wrap: their work in one piece
        return (sum(profiled),)
    return (sum(profiled) / count,) * count


def _block_seconds(
    count: int, flops: FlopProfile, work: WorkRates
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Seconds of each wrapped block's forward and backward in one micro-batch
    (:func:`per_analysed_block` of the profile's per block)."""
    fwd, bwd = _pass_seconds(flops, "forward", work), _pass_seconds(flops, "backward", work)
    return per_analysed_block(fwd, count), per_analysed_block(bwd, count)


def _fp32_share(candidate: Candidate, gpu: GPUSpec, peak: float) -> float:
    """How much more of its achievable rate an fp32 step on the CUDA cores reaches than a
    tensor-core step (``GPUSpec.fp32_step_efficiency`` over ``step_efficiency``; 1 where the
    entry has no fp32 figure, and for TF32, whose peak is the tensor cores')."""
    cuda_cores = candidate.precision is Precision.FP32 and peak == gpu.fp32_flops
    if not cuda_cores or gpu.fp32_step_efficiency is None:
        return 1.0
    return gpu.fp32_step_efficiency / gpu.step_efficiency


def work_rates(candidate: Candidate, gpu: GPUSpec, factors: SpeedFactors, peak: float) -> WorkRates:
    """Seconds per profiled FLOP, byte of memory traffic and new tensor byte (fp32, at micro-batch
    1: FLOPs and traffic are linear in it) at the candidate's micro-batch.

    Matrix products and fused attention each reach their own share of the peak on this GPU
    (catalogue facts: an H100 runs large products at 80% of its peak but FlashAttention-2 at
    35%, an A100 at 87% and ~60%), and a training step a share of that (compute_efficiency).
    The shares were measured in bf16; fp32 and TF32 steps get the same shares of their peaks
    (no catalogued measurement), which the trials' calibration corrects."""
    mbs = candidate.micro_batch_size
    efficiency = factors.compute_efficiency * _fp32_share(candidate, gpu, peak)
    flop_s = peak * gpu.matmul_fraction * efficiency / mbs
    attention_s = peak * gpu.attention_fraction * efficiency / mbs
    _, cb = element_bytes(candidate.precision)
    if gpu.host_is_device:
        # CPU kernels compute bf16 element-wise work in fp32 and convert: no fewer bytes/s
        cb = 4
    byte_s = gpu.hbm_bandwidth * factors.memory_efficiency * 4 / cb / mbs
    # New tensors, written into fresh pages where the process maps them afresh (CPU workers).
    fresh_s = gpu.fresh_page_bandwidth * 4 / cb / mbs if gpu.fresh_page_bandwidth else None
    op_s = (
        op_host_seconds(candidate, factors.op_overhead_s)
        if not gpu.host_is_device
        else (factors.op_overhead_s)
    )
    return WorkRates(
        flop_s, attention_s, byte_s, op_s,
        host_is_device=gpu.host_is_device, fresh_s=fresh_s,
    )  # fmt: skip


@lru_cache(maxsize=64)
def piece_seconds(
    block_count: int, flops: FlopProfile, work: WorkRates, selective: bool
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], float, float]:
    """(forward, backward, recompute seconds of each block; forward, backward seconds of the
    rest) of one micro-batch: the same for every candidate of the same FLOPs and rates, so
    computed once."""
    fwd, bwd = _block_seconds(block_count, flops, work)
    # what a checkpointed block runs again: its forward, or the part selective reruns
    rerun = flops.selective_recompute() if selective else None
    rec = _block_seconds(block_count, rerun, work)[0] if rerun else fwd
    f = flops
    other_fwd = work.seconds(
        f.other_forward, f.other_forward_attention, f.other_forward_traffic,
        f.other_forward_ops, f.other_forward_fresh,
    )  # fmt: skip
    other_bwd = work.seconds(
        f.other_backward, f.other_backward_attention, f.other_backward_traffic,
        f.other_backward_ops, f.other_backward_fresh,
    )  # fmt: skip
    return fwd, bwd, rec, other_fwd, other_bwd
