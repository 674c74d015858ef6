"""Analytic per-rank memory of an FSDP candidate: pure arithmetic after one activation profile
(:mod:`autoshard.predict.activations`).

The per-rank peak is the largest of the live bytes over the events of a training step's timeline
(:func:`~autoshard.predict.step_memory.step_events`, in the order the step runs them; the peak
event's name is the moment the report shows), each a sum of terms
(:mod:`autoshard.predict.step_bytes`):
- sharded parameters, gradients and optimizer states: ``P x bytes / shard_size``;
- the unsharded working set: the unit being computed and the prefetched next one (2 x largest
  unit in the compute dtype) and the root unit, or the whole model for SHARD_GRAD_OP (no
  reshard after forward);
- communication buffers: the reduce-scatter input of one unit in the reduce dtype;
- activations saved for backward, by the checkpointing choice; the loss's fp32 log-probabilities;
- temporaries: the logits and their gradient, one block's recomputed activations and gradients,
  the foreach optimizer's transient copy of the shard;
- buffers, and an allowance for what a CPU cannot see (CUDA context, NCCL, what FSDP2's
  communication streams keep reserved: :mod:`autoshard.predict.allocator`, allocator slack).
Calibrated against torch's memory tracker on fake tensors (:mod:`autoshard.predict.simulate`) and
checked against measured runs by ``benchmarks/estimate_accuracy.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.config import Candidate, Engine, Hardware, Loop, WorkloadSpec
from autoshard.engine import as_run
from autoshard.predict.activations import ActivationProfile, rule_of_thumb
from autoshard.predict.allocator import ReservedPeak, reserved_peak, stream_pools
from autoshard.predict.recipe import recipe_activations
from autoshard.predict.step_bytes import step_bytes
from autoshard.predict.step_memory import MemoryEvent, peak_event, step_events, walk_step
from autoshard.results import MemoryBreakdown, MemoryEstimate, ModelProfile
from autoshard.units import format_bytes

# as_run: the simulation's set-up reads it here
__all__ = [
    "ALLOCATOR_SLACK",
    "CUDA_CONTEXT_BYTES",
    "allowance",
    "as_run",
    "estimate_all",
    "estimate_memory",
    "estimate_reserved",
    "memory_events",
    "needs_simulation",
    "peak_moments",
    "stream_pools_of",
]

# What a CPU cannot see on a GPU: the CUDA context and cuBLAS workspace (about 0.5-1 GiB on
# recent GPUs), NCCL's buffers, and the caching allocator's reserved-over-allocated slack beyond
# FSDP2's stream pools (predict.allocator). Uncalibrated until a GPU run measures it
# (benchmarks/gpu.sh accuracy: reserved_memory_measured.py), so stated as an allowance.
CUDA_CONTEXT_BYTES = 1 * 1024**3
ALLOCATOR_SLACK = 0.05


def allowance(subtotal: int, hardware: Hardware, pools: int = 0) -> int:
    """What a CPU cannot see on a GPU, for a peak of ``subtotal`` counted bytes beside which
    FSDP2's communication streams keep ``pools`` bytes reserved
    (:mod:`autoshard.predict.allocator`); nothing for CPU processes (gloo), where there is no
    CUDA context or caching allocator."""
    if hardware.backend == "gloo":
        return 0
    return CUDA_CONTEXT_BYTES + pools + int(subtotal * ALLOCATOR_SLACK)


def stream_pools_of(estimate: MemoryEstimate, hardware: Hardware) -> int:
    """What of an analytic estimate's allowance is FSDP2's stream pools
    (:func:`allowance`'s ``pools``): a simulation of the same candidate adds the same."""
    counted = estimate.gpu_peak - estimate.breakdown.allowance
    return estimate.breakdown.allowance - allowance(counted, hardware)


def peak_moments(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    acts: ActivationProfile,
) -> tuple[dict[str, MemoryBreakdown], int]:
    """The per-rank bytes at each moment that can hold the peak of a training step (before the
    allowance), in the order the step runs them (:func:`autoshard.predict.step_memory.step_events`
    by name), and the host bytes per node.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec
    >>> from autoshard import analyze_target, peak_moments, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> workload = WorkloadSpec(seq_len=128, loop="plain")  # zero_grad after step
    >>> candidate = Candidate(wrap_classes=profile.wrap_policy)
    >>> gpus = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30)
    >>> acts = profile_activations(built.model, profile, workload)
    >>> moments, host = peak_moments(profile, candidate, gpus, workload, acts)
    >>> for moment in moments:  # in the order the step runs them
    ...     print(moment)
    last block forward
    root forward end
    loss
    head backward
    top block backward
    top block gradient
    second block backward
    block above the bottom backward
    bottom block backward
    bottom block gradient
    root backward
    optimizer step
    >>> host  # nothing offloaded
    0
    >>> trainer = WorkloadSpec(seq_len=128, loop="lightning")  # zero_grad before backward
    >>> lightning, _ = peak_moments(profile, candidate, gpus, trainer, acts)
    >>> for moment in sorted(lightning.keys() - moments):  # the last step's gradients alive
    ...     print(moment)
    forward end, last step's gradients
    last block forward, last step's gradients
    loss, last step's gradients
    root forward end, last step's gradients
    """
    events, host = step_events(profile, candidate, hardware, workload, acts)
    return {event.name: event.live for event in events}, host


def needs_simulation(
    profile: ModelProfile, candidate: Candidate, workload: WorkloadSpec
) -> str | None:
    """Why the analytic estimate of ``candidate`` would be a guess, in one line, or None when
    it is modelled (and checked by ``benchmarks/estimate_accuracy.py``). Where it returns a
    reason, estimate by simulation (:func:`autoshard.predict.simulate.simulate_memory`) or, for
    CPU offload, which cannot be simulated on a CPU, by a trial.

    >>> from autoshard import Candidate, WorkloadSpec, analyze_model
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    >>> model[0].requires_grad_(False)  # doctest: +ELLIPSIS
    Linear(...)
    >>> profile = analyze_model(model)
    >>> needs_simulation(profile, Candidate(), WorkloadSpec()) is None
    True
    >>> needs_simulation(profile, Candidate(min_num_params=10), WorkloadSpec())[:46]
    'frozen parameters under a size-based wrap poli'
    """
    if workload.loop not in (Loop.LIGHTNING, Loop.PLAIN):
        return f"the training loop {workload.loop.value!r} is not modelled; simulate it"
    if (
        profile.frozen_params
        and candidate.engine is Engine.FSDP1
        and not candidate.one_unit
        and not candidate.wrap_classes
    ):
        return (
            "frozen parameters under a size-based wrap policy: which FSDP1 units train (and so "
            "hold a full flat gradient) is not known before wrapping; simulate it"
        )
    if workload.accumulate > 1 and candidate.cpu_offload:
        return (
            "gradient accumulation with CPU offload is not modelled (where the kept gradients "
            "live depends on the engine); measure it with a trial"
        )
    if workload.accumulate > 1 and candidate.hybrid_mesh is not None:  # a hybrid sharding
        return (
            f"gradient accumulation with {candidate.sharding.value} is not checked against a "
            "measurement; simulate it"
        )
    return None


def estimate_memory(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    activations: ActivationProfile | None = None,
) -> MemoryEstimate:
    """Predict the per-rank GPU peak and per-node host memory of ``candidate``.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec
    >>> from autoshard import analyze_target, estimate_memory, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> workload = WorkloadSpec(seq_len=128)
    >>> acts = profile_activations(built.model, profile, workload)
    >>> gpus = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30)
    >>> full = estimate_memory(profile, Candidate(wrap_classes=profile.wrap_policy), gpus,
    ...                        workload, activations=acts)
    >>> full.method, full.fits, full.gpu_peak == full.breakdown.total
    ('analytic', True, True)
    >>> replicated = estimate_memory(
    ...     profile, Candidate(wrap_classes=profile.wrap_policy, sharding="NO_SHARD"), gpus,
    ...     workload, activations=acts)
    >>> replicated.breakdown.optimizer == 8 * full.breakdown.optimizer  # AdamW, 8 ranks
    True
    """
    acts = _acts(profile, candidate, workload, activations)
    t = step_bytes(profile, candidate, hardware, workload, acts)
    events, host = walk_step(t, hardware, workload), t.host_bytes
    at = peak_event(events)
    peak_at = at.name
    # Of what the allocator reserves beyond the peak, FSDP2's stream pools (read in torch's code)
    # are planned on; the loss's hole is left to the slack: deduced, unmeasured, and a fused
    # cross-entropy has none (benchmarks/results/published_memory.md).
    pools = stream_pools(t, hardware, at)
    breakdown = at.live.model_copy(update={"allowance": allowance(at.live.total, hardware, pools)})
    peak = breakdown.total
    usable = hardware.usable_gpu_memory
    reasons = []
    if peak > usable:
        reasons.append(f"needs {peak / 2**30:.1f} GiB per GPU, {usable / 2**30:.1f} GiB usable")
    if hardware.host_memory is not None and host > hardware.host_memory:
        reasons.append(
            f"needs {format_bytes(host)} of host memory per node, "
            f"{format_bytes(hardware.host_memory)} given"
        )
    return MemoryEstimate(
        candidate=candidate,
        method="analytic",
        peak_at=peak_at,
        gpu_peak=peak,
        host_peak=host,
        breakdown=breakdown,
        fits=not reasons,
        headroom=usable - peak,
        reason="; ".join(reasons),
    )


def _acts(
    profile: ModelProfile,
    candidate: Candidate,
    workload: WorkloadSpec,
    activations: ActivationProfile | None,
) -> ActivationProfile:
    acts = activations or rule_of_thumb(profile, workload, "no activation profile given")
    return recipe_activations(candidate, acts)  # what torch.compile no longer saves


def memory_events(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    activations: ActivationProfile | None = None,
) -> list[MemoryEvent]:
    """The events of ``candidate``'s step, in the walk's order, of which :func:`estimate_memory`
    reports the peak (:func:`~autoshard.predict.step_memory.peak_event`)."""
    acts = _acts(profile, candidate, workload, activations)
    t = step_bytes(profile, candidate, hardware, workload, acts)
    return walk_step(t, hardware, workload)


def compile_saving(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    activations: ActivationProfile | None = None,
) -> int:
    """What torch.compile takes off the forward and backward's peak of ``candidate`` (0 where
    it does not compile): its eager twin's largest live bytes outside the optimizer step less
    its own (:func:`~autoshard.predict.recipe.recipe_activations`: AOTAutograd's partitioner
    recomputes element-wise results instead of saving them). The simulation runs eager FSDP code
    on fake tensors, never inductor, and takes this off its forward-and-backward phase."""
    if not candidate.compile:
        return 0

    def loop_peak(c: Candidate) -> int:
        events = memory_events(profile, c, hardware, workload, activations=activations)
        return max((e.live.total for e in events if e.stage != "step"), default=0)

    eager = candidate.model_copy(update={"compile": False})
    return max(loop_peak(eager) - loop_peak(candidate), 0)


def estimate_reserved(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    activations: ActivationProfile | None = None,
) -> ReservedPeak:
    """The allocated peak of ``candidate``'s step (no allowance) and what the CUDA caching
    allocator reserves beyond it: the number to hold against a measured
    ``torch.cuda.max_memory_reserved``. :func:`estimate_memory`'s ``gpu_peak`` is the allocated
    peak plus its allowance, which counts the stream pools but not the loss's hole.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec
    >>> from autoshard import analyze_target, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> workload = WorkloadSpec(seq_len=128)
    >>> acts = profile_activations(built.model, profile, workload)
    >>> gpus = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30)
    >>> fsdp2 = Candidate(wrap_classes=profile.wrap_policy, engine="fsdp2")
    >>> peak = estimate_reserved(profile, fsdp2, gpus, workload, activations=acts)
    >>> peak.reserved > peak.allocated  # FSDP2's stream pools, the loss's hole
    True
    >>> gloo = gpus.model_copy(update={"backend": "gloo"})
    >>> cpu = estimate_reserved(profile, fsdp2, gloo, workload, activations=acts)
    >>> cpu.reserved == cpu.allocated  # no caching allocator
    True
    """
    acts = _acts(profile, candidate, workload, activations)
    t = step_bytes(profile, candidate, hardware, workload, acts)
    events = walk_step(t, hardware, workload)
    return reserved_peak(t, hardware, events, peak_event(events), workload.seq_len or 0)


def estimate_all(
    profile: ModelProfile,
    candidates: Sequence[Candidate],
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    activations: ActivationProfile | None = None,
) -> list[MemoryEstimate]:
    """Estimate every candidate (milliseconds each).

    >>> from autoshard import Hardware, TargetSpec, WorkloadSpec, analyze_target
    >>> from autoshard import enumerate_candidates, estimate_all, profile_activations
    >>> from autoshard.space import Knobs
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> gpus = Hardware(gpus_per_node=8, gpu_memory=2 * 2**30)
    >>> workload = WorkloadSpec(seq_len=128)
    >>> sizes = Knobs(micro_batch_sizes=(1, 256))
    >>> candidates = enumerate_candidates(profile, gpus, workload, sizes)
    >>> acts = profile_activations(built.model, profile, workload)
    >>> estimates = estimate_all(profile, candidates, gpus, workload, activations=acts)
    >>> 0 < sum(e.fits for e in estimates) < len(candidates)  # some of micro-batch 256 overflow
    True
    """
    return [
        estimate_memory(profile, c, hardware, workload, activations=activations) for c in candidates
    ]
