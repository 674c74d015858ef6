"""THE planning pipeline. Every door (``autoshard.estimate / recommend / tune``, the command line,
export and the reports) goes through here, so the same inputs give the same answer:

    PlanOptions (what the user said: flags or keyword arguments, validated once: autoshard.options)
      -> PlanRequest (resolved: target, hardware (autoshard.detect), engine, precisions, sizes)
      -> make_plan: build on meta, analyse, candidates, activation profile, estimates, the
         step-time model's speed of each, ranking (one order: space.rank_candidates)
      -> autoshard.decide: decide (estimates only) or decide_from_trials (after a study)
      -> Recommendation (one builder: autoshard.decide.build_recommendation)

Every fallback that changes a number (an assumed sequence length, activations guessed because
the forward cannot run on fake tensors, an assumed GPU model) is a :class:`PlanWarning`, raised
through :mod:`warnings` at every door; the command line prints each as one line.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from autoshard.analyze import analyze_model
from autoshard.config import Candidate, Frozen, Hardware, Precision, RankOrder, WorkloadSpec
from autoshard.detect import detect_hardware
from autoshard.errors import ConfigError, PlanWarning
from autoshard.options import PlanOptions
from autoshard.predict.activations import ActivationProfile, precisions_of, profile_activations
from autoshard.predict.analytic import compile_saving, estimate_all
from autoshard.predict.attention_kernels import attention_device
from autoshard.predict.calibrate import SpeedModel
from autoshard.results import MemoryEstimate, ModelProfile
from autoshard.space import (
    BF16_COMPUTE,
    Knobs,
    default_precisions,
    enumerate_candidates,
    float8_blocker,
    rank_candidates,
)
from autoshard.target.adapters import to_target
from autoshard.target.resolve import BuiltModel, TargetSpec, build_target
from autoshard.units import format_bytes
from autoshard.workload import micro_batch_sizes, resolve_workload


class PlanRequest(Frozen):
    """A resolved request: everything :func:`make_plan` needs, nothing left to guess."""

    target: TargetSpec
    label: str = Field("", description="What the model is called in reports.")
    hardware: Hardware
    options: PlanOptions


def make_request(
    model: Any,
    options: PlanOptions,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    out_dir: Path | None = None,
    trials: bool = False,
    hardware: Hardware | None = None,
) -> PlanRequest:
    """Resolve ``model`` (anything :func:`autoshard.target.adapters.to_target` takes: a target
    string, a factory, a module, a LightningModule, a Hugging Face model) and the hardware."""
    target = to_target(model, kwargs=kwargs, batch=batch, out_dir=out_dir)
    return PlanRequest(
        target=target,
        label=_label(model, target),
        hardware=hardware or detect_hardware(options, trials=trials),
        options=options,
    )


def _label(model: Any, target: TargetSpec) -> str:
    if isinstance(model, str):
        return str(target) if not model else " ".join([model, *_kwargs_text(target)])
    if isinstance(model, TargetSpec):
        return str(model)
    if isinstance(model, torch.nn.Module):
        return f"{type(model).__module__}.{type(model).__qualname__}"
    return str(target)


def _kwargs_text(target: TargetSpec) -> list[str]:
    inner = target.kwargs.get("kwargs") if "factory" in target.kwargs else target.kwargs
    return [f"{k}={v!r}" for k, v in dict(inner or {}).items()]


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A model analysed and every candidate estimated, ranked fastest predicted first."""

    request: PlanRequest
    built: BuiltModel
    profile: ModelProfile
    workload: WorkloadSpec
    candidates: tuple[Candidate, ...]
    activations: ActivationProfile
    estimates: tuple[MemoryEstimate, ...]
    speed: SpeedModel
    notes: tuple[str, ...] = field(default=())

    @property
    def hardware(self) -> Hardware:
        return self.request.hardware

    def ranked(self, order: RankOrder | str = RankOrder.SPEED) -> list[MemoryEstimate]:
        """Fitting candidates first (fastest predicted, or most headroom), then the rest by
        how far they overshoot."""
        return rank_candidates(
            self.estimates, order, host_memory_checked=self.hardware.host_memory is not None
        )


def make_plan(request: PlanRequest) -> Plan:
    """Analyse the model, enumerate candidates, profile activations and estimate them all."""
    opts = request.options
    built = build_target(request.target)
    profile = analyze_model(
        built.model, target=request.label or str(request.target), built_on=built.built_on,
        extra_warnings=built.warnings,
    )  # fmt: skip
    workload, notes = resolve_workload(
        built, opts, request.label or str(request.target), profile=profile
    )
    candidates = enumerate_candidates(
        profile, request.hardware, workload, knobs_for(opts, built, request.hardware)
    )
    activations = profile_activations(
        built.model, profile, workload, batch=built.batch, precisions=precisions_of(candidates),
        attention_on=attention_device(request.hardware),
    )  # fmt: skip
    if activations.note:
        notes.append(activations.note)
    speed = SpeedModel.build(profile, built.model, request.hardware, workload, batch=built.batch)
    if speed.flops.note:
        notes.append(speed.flops.note)
    if speed.note:
        notes.append(speed.note)
    estimates = speed.attach(
        estimate_all(profile, candidates, request.hardware, workload, activations=activations)
    )
    checked = request.hardware.host_memory is not None
    if opts.simulate:
        from autoshard.predict.simulate import refine_with_simulation, simulated_count

        simulated_count(opts.simulate, estimates)  # more than there are: one line, not minutes

        def saving(candidate: Candidate) -> int:
            return compile_saving(
                profile, candidate, request.hardware, workload, activations=activations
            )

        simulated = refine_with_simulation(
            request.target, rank_candidates(estimates, host_memory_checked=checked),
            request.hardware, workload,
            block_classes=profile.block_classes, count=opts.simulate, compile_saving=saving,
        )  # fmt: skip
        estimates = speed.attach(simulated)  # simulated peaks can change fit and headroom
    estimates = rank_candidates(estimates, host_memory_checked=checked)
    host_note = host_memory_note(estimates, request.hardware)
    if host_note:
        notes.append(host_note)
    pressure = memory_pressure_note(estimates)
    if pressure:
        notes.append(pressure)
    for note in notes:
        warnings.warn(note, PlanWarning, stacklevel=2)
    return Plan(
        request=request,
        built=built,
        profile=profile,
        workload=workload,
        candidates=tuple(candidates),
        activations=activations,
        estimates=tuple(estimates),
        speed=speed,
        notes=tuple(notes),
    )


def knobs_for(options: PlanOptions, built: BuiltModel, hardware: Hardware) -> Knobs:
    """What the user's options fix or narrow in the space, on ``hardware``."""
    compiles, float8s, precisions = planned_switches(options, hardware)
    return Knobs(
        engine=options.engine,
        optimizer=options.optimizer,
        precisions=precisions,
        micro_batch_sizes=micro_batch_sizes(built, options),
        compiles=compiles,
        float8s=float8s,
    )


def compile_supported() -> str | None:
    """Why torch.compile cannot run here (this Python, this platform); None when it can.

    Asked of ``torch.compile`` in its decorator form, which checks the platform and returns
    before it imports ``torch._dynamo`` (1.2 s of CPU an estimate need not spend)."""
    try:
        torch.compile(backend="eager")
    except RuntimeError as exc:
        return f"torch {torch.__version__} cannot compile on this Python or platform ({exc})"
    return None


def planned_switches(
    options: PlanOptions, hardware: Hardware
) -> tuple[tuple[bool, ...], tuple[bool, ...], tuple[Precision, ...] | None]:
    """The torch.compile and float8 values to plan, and the precisions (float8 pinned on keeps
    the bf16 ones): a pin is taken as given, or is one line saying why it cannot be; unpinned,
    both values where the stack supports it (only off otherwise); the step-time and memory models
    know both effects (predict/recipe.py)."""
    if options.compile is None:
        compiles = (False, True) if not compile_supported() else (False,)
    elif options.compile and (why := compile_supported()):
        raise ConfigError(f"compile (--compile) is pinned on, but {why}: leave it unpinned")
    else:
        compiles = (options.compile,)
    precisions = options.precision
    blocker = float8_blocker(hardware, options.engine)
    if options.float8 is None:
        float8s = (False, True) if not blocker else (False,)
    elif not options.float8:
        float8s = (False,)
    else:
        if blocker:
            raise ConfigError(f"float8 (--float8) is pinned on, but {blocker}")
        if precisions is None:
            precisions = tuple(p for p in default_precisions(hardware) if p in BF16_COMPUTE)
        others = [p.value for p in precisions if p not in BF16_COMPUTE]
        if others:
            raise ConfigError(
                f"float8 (--float8) is pinned on, but it trains with bf16 compute, not "
                f"{', '.join(others)}: give --precision bf16-mixed (or bf16-true)"
            )
        float8s = (True,)
    return compiles, float8s, precisions


def host_memory_note(estimates: list[MemoryEstimate], hardware: Hardware) -> str | None:
    """The assumption behind an offloading answer when the host memory is unknown: the
    candidate ranked first (what estimates recommend) offloads, and its need is unchecked."""
    first = estimates[0] if estimates else None
    if hardware.host_memory is not None or first is None or not first.fits:
        return None
    if not first.candidate.cpu_offload:
        return None
    return (
        f"offload needs {format_bytes(first.host_peak)} of host memory per node "
        f"({first.candidate.label()}), assumed to be there (no host memory given); give "
        "--host-memory / host_memory= for yours"
    )


def memory_pressure_note(estimates: list[MemoryEstimate]) -> str | None:
    """A warning when the first-ranked candidate fits only just: its predicted peak within a
    few percent of the usable memory, where allocator retries slow a step (its predicted speed
    already counts it: ``breakdown.pressure_s``) and an estimate a little low means OOM."""
    best = next((e for e in estimates if e.fits), None)
    if best is None or best.speed is None or best.speed.breakdown.pressure_s <= 0:
        return None
    usable = best.gpu_peak + best.headroom
    pressure = best.speed.breakdown.pressure_s
    slower = pressure / (best.speed.step_time_s - pressure)
    return (
        f"memory pressure: the first candidate ({best.candidate.label()}) peaks at "
        f"{format_bytes(best.gpu_peak)} of {format_bytes(usable)} usable "
        f"({best.headroom / usable:.1%} to spare): the allocator's retries near the limit are "
        f"predicted to cost it {slower:.0%}, and a peak a little above the estimate runs out of "
        "memory; a smaller micro-batch or more checkpointing gives it room"
    )


def fits_elsewhere(plan: Plan, *, max_nodes: int = 1024) -> tuple[int, MemoryEstimate] | None:
    """The fewest nodes (of the plan's GPUs per node) on which some candidate fits, with the
    one of most headroom there; None when none fits on ``max_nodes`` either. Doubling, then
    bisection: more nodes shard parameters, gradients and optimizer states thinner, on GPU and
    host."""
    opts = plan.request.options

    def first_fitting(nodes: int) -> MemoryEstimate | None:
        hardware = plan.hardware.model_copy(update={"nodes": nodes})
        candidates = enumerate_candidates(
            plan.profile, hardware, plan.workload, knobs_for(opts, plan.built, hardware)
        )
        estimates = estimate_all(
            plan.profile, candidates, hardware, plan.workload, activations=plan.activations
        )
        # ordered as a plan on these nodes orders them (by speed there), so that a tie in
        # headroom goes to the candidate that plan would name
        estimates = rank_candidates(replace(plan.speed, hardware=hardware).attach(estimates))
        fitting = rank_candidates(estimates, RankOrder.HEADROOM)
        return fitting[0] if fitting and fitting[0].fits else None

    low = plan.hardware.nodes
    if low >= max_nodes:
        return None
    high = min(low * 2, max_nodes)  # doubling, the last step cut to max_nodes (3 is tried)
    while (found := first_fitting(high)) is None:
        if high >= max_nodes:
            return None
        low, high = high, min(high * 2, max_nodes)
    while high - low > 1:
        middle = (low + high) // 2
        there = first_fitting(middle)
        if there is None:
            low = middle
        else:
            high, found = middle, there
    return high, found
