"""The step time of a candidate on the planned GPUs: arithmetic after one FLOP profile
(:mod:`autoshard.predict.flops`), well under a millisecond per candidate.

One optimizer step of one rank is the sum of
- **compute**: the forward and backward FLOPs of ``accumulate`` micro-batches over the GPU's
  dense peak at the candidate's precision (bf16/fp16 tensor cores under ``bf16-mixed``,
  ``16-mixed``, ``bf16-true``; under ``32-true`` the fp32 CUDA-core rate, because torch multiplies
  fp32 matrices at "highest" precision unless told otherwise and Lightning's ``32-true`` does not
  tell it) times the share of it the GPU's kernels can reach (catalogue facts: matrix products
  ``matmul_fraction``, fused attention ``attention_fraction``, counted apart because attention
  kernels reach a smaller share, on an H100 much smaller, and their FLOPs grow with the square
  of the sequence) times ``compute_efficiency``, plus the bytes the memory-bound operations move
  (normalisations, activations, the loss, counted in the FLOP profile) over the GPU's memory
  bandwidth times ``memory_efficiency`` (a roofline: an H100 has 3.2x an A100's FLOP/s but 1.6x
  its bandwidth, so these operations take a larger share of its step);
- **recompute**: the same for the forward of the checkpointed blocks, again in backward;
- **exposed communication**: the collectives FSDP runs, on a timeline with the compute (two
  streams, :func:`timeline`): each unit's all-gather is issued when the unit before it starts
  computing (FSDP's prefetch), so it hides behind that unit's compute; a reduce-scatter starts
  when its unit's backward is done. What the compute does not hide is exposed; a model that is
  one FSDP unit hides nothing (its gather comes before all its compute, its reduction after);
- **contention**: hiding is not free: while a collective runs beside it, the compute runs slower
  (NCCL's kernels take SMs and memory bandwidth from it), by ``overlap_slowdown``; the seconds
  this adds to the timeline;
- **offload** (CPU offload): parameter shards to the GPU at every gather and gradient shards back,
  over the host link, and the optimizer step on the host CPU, bound by its memory bandwidth;
- **optimizer**: otherwise the optimizer step on the GPU, bound by HBM bandwidth.

The collectives' seconds: :mod:`autoshard.predict.collectives`.

The factors (:class:`SpeedFactors`) say how much of each peak is reached; trials calibrate them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from autoshard.config import (
    Candidate,
    Checkpointing,
    Hardware,
    WorkloadSpec,
)
from autoshard.engine import (
    as_run,
    policy_of,
)
from autoshard.gpus import GPUSpec
from autoshard.predict.ceilings import mfu_cap_seconds
from autoshard.predict.collectives import Collectives
from autoshard.predict.factors import DEFAULT_FACTORS, SpeedFactors, default_factors
from autoshard.predict.flops import FlopProfile
from autoshard.predict.hardware import dense_flops, speed_for
from autoshard.predict.host_bound import HostStep, host_bound_seconds
from autoshard.predict.intervals import model_class, with_interval
from autoshard.predict.optimizer_step import (
    ShardStep,
    host_optimizer_threads,
    optimizer_and_offload,
)
from autoshard.predict.recipe import RecipeStep
from autoshard.predict.speed_inputs import SpeedInputs, SpeedOptions
from autoshard.predict.timeline import (
    MicroBatch,
    Pass,
    PassSeconds,
    Turn,
    Unit,
    Work,
    pass_seconds,
    step_timeline,
    two_streams,
)
from autoshard.predict.work_seconds import WorkRates, piece_seconds, work_rates
from autoshard.results import ModelProfile, SpeedBreakdown, SpeedEstimate

if TYPE_CHECKING:  # typing.Unpack: Python 3.11; the annotations are never evaluated
    from typing import Unpack


# ---------------------------------------------------------------------------------------------
# The prediction
# ---------------------------------------------------------------------------------------------


class _StepSeconds:
    """Seconds of each piece of work of one micro-batch and of each collective."""

    def __init__(
        self, profile: ModelProfile, flops: FlopProfile, work: WorkRates, comm: Collectives, *,
        selective: bool = False,
    ):  # fmt: skip
        pieces = piece_seconds(profile.block_count, flops, work, selective)
        self.fwd, self.bwd, self.rec, self.other_fwd, self.other_bwd = pieces
        self.comm = comm
        self._gathers: dict[float, float] = {}
        self._reduces: dict[float, float] = {}

    def work(self, piece: Work) -> float:
        if piece.blocks is None:
            return self.other_bwd if piece.kind is Pass.BACKWARD else self.other_fwd
        kind, blocks = piece.kind, piece.blocks
        per_block = (
            self.bwd if kind is Pass.BACKWARD else self.rec if kind is Pass.RECOMPUTE else self.fwd
        )
        if len(blocks) == 1:  # a block's turn: no sum to start (the same number)
            return per_block[blocks[0]]
        return sum(per_block[i] for i in blocks)

    def unit(self, turn: Turn) -> Unit:
        gather = self._collective(self.comm.all_gather, turn.gathered, self._gathers)
        reduce = self._collective(self.comm.reduce, turn.reduced, self._reduces)
        return gather, sum((self.work(piece) for piece in turn.work), 0.0), reduce

    @staticmethod
    def _collective(
        seconds: Callable[[float], float], elements: float, known: dict[float, float]
    ) -> float:
        """Seconds of a collective of ``elements``, each size once (every block's is the same)."""
        if not elements:
            return 0.0
        if elements not in known:
            known[elements] = seconds(elements)
        return known[elements]


def _overlapped(
    step: list[tuple[MicroBatch, list[Unit], list[Unit]]], prefetch: bool, slowdown: float
) -> tuple[float, float]:
    """(elapsed, communication) seconds of the step's micro-batches (each with its forward and
    backward units) on two streams."""
    elapsed = comm_seconds = 0.0
    for mb, forward, backward in step:
        f_elapsed, f_comm = two_streams(forward, slowdown=slowdown)
        b_elapsed, b_comm = two_streams(backward, prefetch=prefetch, slowdown=slowdown)
        elapsed += mb.count * (f_elapsed + b_elapsed)
        comm_seconds += mb.count * (f_comm + b_comm)
    return elapsed, comm_seconds


def _distributed_seconds(
    step: list[MicroBatch], comm: Collectives, gpu: GPUSpec, factors: SpeedFactors
) -> float:
    """Seconds the compute stream spends on FSDP's copies around its collectives in one step:
    each all-gather's output copied out into the unit's parameters and each reduce-scatter's
    input copied in from the gradients (FSDP1: the gradients divided before the reduction), each
    read and written at the memory-bound rate. None on one GPU or without sharding (FSDP1 runs
    NO_SHARD there; an all-reduce works in place).

    Sources: the copies sit on the compute stream's critical path, 'about 1.4% of the total
    iteration time' of Llama 3 70B on one 8-GPU node (pytorch/pytorch issue #157027: the
    trace's FSDP::all_gather_copy_out and FSDP::post_backward_reduce); a dedicated copy-out
    kernel 'can achieve 650-700GB/s' of output (pytorch/pytorch PR #115515), twice that in
    traffic: a copy at about the HBM rate of an element-wise kernel, as modelled."""
    if comm.shard <= 1:
        return 0.0
    copied = 0.0
    for mb in step:
        for turn in (*mb.forward, *mb.backward):
            copied += mb.count * (
                turn.gathered * comm.gather_bytes + turn.reduced * comm.reduce_bytes
            )
    return 2 * copied / (gpu.hbm_bandwidth * factors.memory_efficiency)  # read and write


def _busy_seconds(
    seconds: _StepSeconds, candidate: Candidate, accumulate: int
) -> tuple[float, float]:
    """(compute, recompute) seconds of a step: ``accumulate`` micro-batches' forward and
    backward, and the checkpointed blocks' forward (or selective's share of it) again."""
    fwd, bwd = seconds.fwd, seconds.bwd
    compute = accumulate * (sum(fwd) + sum(bwd) + seconds.other_fwd + seconds.other_bwd)
    recomputed = (f if candidate.checkpoints(i) else 0.0 for i, f in enumerate(seconds.rec))
    return compute, accumulate * sum(recomputed)


def _exposed_and_contention(
    step: list[MicroBatch],
    seconds: _StepSeconds,
    prefetch: bool,
    factors: SpeedFactors,
    busy_s: float,
) -> tuple[float, float]:
    """(exposed communication, contention) seconds: what the compute does not hide on the
    two-stream timeline, and what hiding costs the compute beside the collectives."""
    # the units' seconds once: the slowed timeline below runs the same units
    units = [
        (mb, [seconds.unit(t) for t in mb.forward], [seconds.unit(t) for t in mb.backward])
        for mb in step
    ]
    elapsed, comm_s = _overlapped(units, prefetch, 0.0)
    hidden_exposed = max(0.0, elapsed - busy_s)
    exposed = factors.overlap * hidden_exposed + (1 - factors.overlap) * comm_s
    # What hiding costs: the same timeline with the compute slowed beside the collectives,
    # counted apart so that "exposed" keeps meaning the collectives the compute did not hide.
    contention_s = 0.0
    if factors.overlap > 0 and factors.overlap_slowdown > 0 and comm_s > 0:
        slowed = _overlapped(units, prefetch, factors.overlap_slowdown)[0]
        contention_s = factors.overlap * max(0.0, slowed - elapsed)
    return exposed, contention_s


class _Set(NamedTuple):
    """What a prediction of one candidate reads: the resolved GPU and factors, the candidate as
    run, its collectives, its work's rates and recipe, and the GPU's dense peak."""

    gpu: GPUSpec
    factors: SpeedFactors
    candidate: Candidate
    comm: Collectives
    rates: WorkRates
    recipe: RecipeStep
    peak: float

    @classmethod
    def up(cls, inputs: SpeedInputs, candidate: Candidate) -> _Set:
        hardware = inputs.hardware
        gpu = speed_for(hardware)[0] if inputs.gpu is None else inputs.gpu
        factors = inputs.factors or default_factors(gpu)
        candidate = as_run(candidate, hardware)
        peak = dense_flops(gpu, candidate.precision, tf32=inputs.tf32)
        comm = Collectives(
            candidate, hardware, gpu,
            latency_s=factors.collective_latency_s, efficiency=factors.comm_efficiency,
        )  # fmt: skip
        rates = work_rates(candidate, gpu, factors, peak)
        # torch.compile and float8: the work the step runs, its gathers' bytes (predict/recipe.py)
        recipe = RecipeStep.of(candidate, inputs.flops, gpu, inputs.profile, inputs.linears)
        comm.gather_bytes *= recipe.gather_scale
        return cls(gpu, factors, candidate, comm, rates, recipe, peak)


def _turns_of(
    inputs: SpeedInputs, candidate: Candidate, blocks: int
) -> tuple[list[MicroBatch], bool]:
    """The step's micro-batches over ``blocks`` timed blocks, and whether backward prefetches."""
    profile = inputs.profile
    step = step_timeline(
        candidate, inputs.hardware, inputs.workload, blocks=blocks,
        params=float(profile.total_params),
        block_params=float(profile.block_params) if blocks else 0.0, skip_sync=inputs.skip_sync,
    )  # fmt: skip
    return step, policy_of(candidate).prefetches_backward(candidate)


def predict_speed(
    profile: ModelProfile,
    flops: FlopProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    factors: SpeedFactors | None = None,
    **options: Unpack[SpeedOptions],
) -> SpeedEstimate:
    """Predict one optimizer step of ``candidate`` on ``hardware`` with ``factors`` (the
    defaults for the GPU when None) and the keyword ``options`` (``gpu``, ``tf32``,
    ``skip_sync``, ``linears``): :func:`speed_of` on these
    :class:`~autoshard.predict.speed_inputs.SpeedInputs`.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec, analyze_target
    >>> from autoshard.predict.flops import profile_flops
    >>> from autoshard.predict.speed import predict_speed
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "1b"}))
    >>> workload = WorkloadSpec(seq_len=2048)
    >>> flops = profile_flops(built.model, profile, workload)
    >>> nodes = Hardware(gpus_per_node=8, nodes=2, gpu_memory=80 * 2**30, gpu="h100-sxm")
    >>> full = predict_speed(profile, flops, Candidate(wrap_classes=profile.wrap_policy),
    ...                      nodes, workload)
    >>> one_unit = predict_speed(profile, flops, Candidate(), nodes, workload)
    >>> one_unit.breakdown.exposed_comm_s > 3 * full.breakdown.exposed_comm_s  # hides nothing
    True
    >>> 0.1 < full.mfu < 0.55
    True
    """
    return speed_of(SpeedInputs(profile, flops, hardware, workload, factors, **options), candidate)


def speed_of(inputs: SpeedInputs, candidate: Candidate) -> SpeedEstimate:
    """One optimizer step of ``candidate`` on the ``inputs``' hardware (whether the micro-batches
    before the last skip the gradient sync: ``inputs.skip_sync``, None as ``workload.loop``
    does, :func:`~autoshard.engine.skips_gradient_sync`; other trainers differ: Composer
    reduces every micro-batch under FSDP). torch.compile and float8 change the step's work
    through :class:`~autoshard.predict.recipe.RecipeStep`."""
    s = _Set.up(inputs, candidate)
    gpu, candidate, peak = s.gpu, s.candidate, s.peak
    hardware, workload = inputs.hardware, inputs.workload
    mbs, accumulate = candidate.micro_batch_size, workload.accumulate
    total, breakdown = _step_time(inputs, s)
    samples = mbs * accumulate
    tokens = workload.seq_len
    work = accumulate * mbs * inputs.flops.total
    params = float(inputs.profile.total_params)
    cap_s = mfu_cap_seconds(total, work / peak, gpu, candidate, params)
    total += cap_s
    estimate = SpeedEstimate(
        step_time_s=total,
        samples_per_s=samples * hardware.world_size / total,
        tokens_per_s_per_gpu=samples * tokens / total if tokens else None,
        mfu=work / (total * peak),
        breakdown=breakdown.model_copy(update={"mfu_cap_s": cap_s}) if cap_s else breakdown,
        gpu=gpu.id,
        mfu_capped=cap_s > 0,
    )
    return with_interval(estimate, model_class(gpu.generation, candidate.precision, params))


def _step_time(inputs: SpeedInputs, s: _Set) -> tuple[float, SpeedBreakdown]:
    """Seconds of one step of ``s.candidate`` (as run), and their breakdown by cause: the
    ``recipe``'s work at the ``rates``, the collectives ``comm`` times on the step's two-stream
    timeline, the optimizer and offload, FSDP's copies, float8's scale sync, and what compile
    and float8 saved."""
    gpu, factors, candidate, comm, rates, recipe, _ = s
    profile, hardware = inputs.profile, inputs.hardware
    accumulate = inputs.workload.accumulate
    selective = candidate.checkpointing is Checkpointing.SELECTIVE
    run = recipe.flops()  # the work the candidate runs (a copy of the profile under compile)
    seconds = _StepSeconds(profile, run, rates, comm, selective=selective)
    blocks = len(seconds.fwd)
    params = float(profile.total_params)
    step, prefetch = _turns_of(inputs, candidate, blocks)
    compute_s, recompute_s = _busy_seconds(seconds, candidate, accumulate)
    exposed, contention_s = _exposed_and_contention(
        step, seconds, prefetch, factors, compute_s + recompute_s
    )
    offload_s, optimizer_s = optimizer_and_offload(
        candidate, hardware, gpu, factors,
        ShardStep(
            params, comm.shard, accumulate, compute_s + recompute_s,
            host_optimizer_threads(hardware)
            if inputs.host_threads is None
            else float(inputs.host_threads),
        ),
    )  # fmt: skip
    distributed_s = _distributed_seconds(step, comm, gpu, factors)
    scale_sync_s = recipe.scale_sync_s(
        blocks,
        comm.shard,
        factors.collective_latency_s,
        gpu.hbm_bandwidth * factors.memory_efficiency,
    )
    total = compute_s + recompute_s + exposed + contention_s + offload_s + optimizer_s
    total += distributed_s + scale_sync_s
    # a step is no faster than its host issues it (predict/host_bound.py)
    host_bound_s = host_bound_seconds(
        HostStep(step, profile, run, candidate, hardware), op_s=factors.op_overhead_s,
        unit_scale=factors.unit_host_scale, device_s=total - offload_s, tail_s=optimizer_s,
        host_is_device=gpu.host_is_device, float8_layers=recipe.linears.count,
    )  # fmt: skip
    total += host_bound_s

    def busy(work: FlopProfile) -> float:  # compute and recompute seconds of a recipe's work
        step_seconds = _StepSeconds(profile, work, rates, comm, selective=selective)
        return sum(_busy_seconds(step_seconds, candidate, accumulate))

    return total, SpeedBreakdown(
        compute_s=compute_s,
        recompute_s=recompute_s,
        exposed_comm_s=exposed,
        contention_s=contention_s,
        offload_s=offload_s,
        optimizer_s=optimizer_s,
        distributed_s=distributed_s,
        float8_scale_sync_s=scale_sync_s,
        host_bound_s=host_bound_s,
        **recipe.breakdown(busy),
    )


def under_pressure(
    speed: SpeedEstimate, peak: int, usable: int, factors: SpeedFactors | None = None
) -> SpeedEstimate:
    """``speed`` slowed for a predicted ``peak`` within ``pressure_margin`` of the ``usable``
    GPU memory (allocator retries: :class:`SpeedFactors`): ``pressure_slowdown`` of the step at
    the limit, nothing with the margin to spare. A peak beyond the limit is not slowed: that
    candidate does not fit, which ranks it after every one that does, and says why. The
    slowdown is in ``breakdown.pressure_s``; where it is not zero the planner warns.

    >>> from autoshard.results import SpeedEstimate
    >>> fast = SpeedEstimate(step_time_s=1.0, samples_per_s=8.0)
    >>> under_pressure(fast, peak=70, usable=100).step_time_s
    1.0
    >>> round(under_pressure(fast, peak=100, usable=100).step_time_s, 3)
    1.1
    """
    factors = factors or DEFAULT_FACTORS
    if peak > usable or factors.pressure_margin <= 0 or factors.pressure_slowdown <= 0:
        return speed
    near = (peak - usable * (1 - factors.pressure_margin)) / (usable * factors.pressure_margin)
    share = max(0.0, near)
    if share == 0.0:
        return speed
    extra = speed.step_time_s * factors.pressure_slowdown * share
    total = speed.step_time_s + extra
    scale = speed.step_time_s / total
    return speed.model_copy(
        update={
            "step_time_s": total,
            "samples_per_s": speed.samples_per_s * scale,
            "tokens_per_s_per_gpu": (
                None if speed.tokens_per_s_per_gpu is None else speed.tokens_per_s_per_gpu * scale
            ),
            "mfu": None if speed.mfu is None else speed.mfu * scale,
            "interval_s": None
            if speed.interval_s is None
            else (speed.interval_s[0] / scale, speed.interval_s[1] / scale),
            "breakdown": speed.breakdown.model_copy(update={"pressure_s": extra}),
        }
    )


# ---------------------------------------------------------------------------------------------
# The turns' seconds (the step's timeline as a user reads it: autoshard.predict.step_profile)
# ---------------------------------------------------------------------------------------------


def turn_seconds(
    inputs: SpeedInputs, candidate: Candidate
) -> list[tuple[MicroBatch, PassSeconds, PassSeconds]]:
    """Each micro-batch of :func:`predict_speed`'s step with its forward's and backward's turns
    timed, one run of it: their elapsed seconds times each micro-batch's count add up to the
    step's compute, recompute, exposed communication and contention (the rest of the step,
    the optimizer and offload, FSDP's copies, float8's scale sync and the host-bound floor, is
    timed whole in the breakdown). The same inputs as :func:`speed_of`."""
    s = _Set.up(inputs, candidate)
    selective = s.candidate.checkpointing is Checkpointing.SELECTIVE
    seconds = _StepSeconds(inputs.profile, s.recipe.flops(), s.rates, s.comm, selective=selective)
    step, prefetch = _turns_of(inputs, s.candidate, len(seconds.fwd))
    slowdown, overlap = s.factors.overlap_slowdown, s.factors.overlap

    def timed(turns: tuple[Turn, ...], prefetches: bool) -> PassSeconds:
        return pass_seconds([seconds.unit(t) for t in turns], prefetches, slowdown, overlap)

    return [(mb, timed(mb.forward, True), timed(mb.backward, prefetch)) for mb in step]
