"""The decision: which candidate of a :class:`~autoshard.plan.Plan` to recommend, and why.

One place for every door: :func:`decide` from estimates (``recommend()``, ``estimate``, export),
:func:`decide_from_trials` after a study; both build the :class:`Recommendation` through
:func:`build_recommendation`, the only place one is made.

With trials, what decides depends on where they ran (:func:`autoshard.measure.speed_basis`): on
the kind of device planned for, the measurements; on CPU processes standing in for the planned
GPUs, the trials only show that a configuration builds, trains and fits, and the step-time
model's predictions for the planned GPUs decide among those. Either way one rule
(:func:`autoshard.ranking.ranked`): the fastest, unless it is at risk (near the memory limit, or
offloading to host memory no one checked) and a candidate within the noise of it
(:func:`autoshard.ranking.tie`, the one seam) is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Literal

import torch

from autoshard.config import Hardware, WorkloadSpec
from autoshard.errors import ConfigError, TrialsFailedError
from autoshard.measure import (
    speed_basis,
    throughput,
)
from autoshard.plan import Plan, fits_elsewhere
from autoshard.predict.factors import SpeedFactors
from autoshard.predict.step_profile import step_profile
from autoshard.ranking import (
    Contender,
    estimate_contender,
    ranked,
    trial_contender,
)
from autoshard.reasons import (
    described,
    diverged_reason,
    explain_by_prediction,
    explain_estimate,
    explain_trials,
    host_memory_reason,
    predicted_rate,
)
from autoshard.recommendation import Recommendation
from autoshard.results import (
    MemoryEstimate,
    ModelProfile,
    Scored,
    StepTimeline,
    TrialResult,
    TrialStatus,
)
from autoshard.switches import proven_switches
from autoshard.units import format_bytes


def versions() -> dict[str, str]:
    """The versions a recommendation was made with (written into every export's header)."""
    out: dict[str, str] = {"torch": str(torch.__version__)}
    for name in ("autoshard", "transformers", "lightning"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


@dataclass(frozen=True)
class Choice:
    """What a decision chose, from which basis, and why: the candidate first, the others that
    fit or ran (``runners_up``), those that did not (``ruled_out``), one reason per line."""

    chosen: Scored
    runners_up: Sequence[Scored]
    ruled_out: Sequence[Scored]
    basis: Literal["estimate", "trials"]
    reasons: Sequence[str]


def build_recommendation(
    profile: ModelProfile,
    hardware: Hardware,
    workload: WorkloadSpec,
    choice: Choice,
    *,
    notes: Sequence[str] = (),
    timeline: StepTimeline | None = None,
) -> Recommendation:
    """The only place a :class:`Recommendation` is made (``notes``: what the plan assumed;
    ``timeline``: the chosen configuration's step as memory over time)."""
    chosen = choice.chosen
    return Recommendation(
        profile=profile,
        hardware=hardware,
        workload=workload.model_copy(
            update={"micro_batch_size": chosen.candidate.micro_batch_size}
        ),
        chosen=chosen,
        runners_up=tuple(choice.runners_up),
        ruled_out=tuple(choice.ruled_out),
        basis=choice.basis,
        reasons=(*choice.reasons, *host_memory_reason(chosen, hardware), *notes),
        versions=versions(),
        timeline=timeline,
    )


def decide(plan: Plan) -> Recommendation:
    """The fitting candidate predicted to be fastest, with one reason per setting."""
    order = plan.ranked()
    fitting = [e for e in order if e.fits]
    if not fitting:
        raise ConfigError(nothing_fits(plan))
    # a torch.compile or float8 gain the model cannot tell from its own error is not proposed
    best, switch_lines = proven_switches(fitting[0], fitting)
    said = {line.split(" ", 1)[0] for line in switch_lines}  # their lines replace the plain ones
    reasons = [r for r in explain_estimate(best, plan) if r.split(" ", 1)[0] not in said]
    if best is not fitting[0]:  # the rule's first line, for the twin the switches left first
        reasons.insert(1, (
            f"fastest of {len(fitting)} predicted configurations once a torch.compile or float8 "
            f"gain the model cannot tell from its own error is left out: {described(best)}"
        ))  # fmt: skip
    others = [Scored(candidate=e.candidate, estimate=e) for e in fitting if e is not best]
    return build_recommendation(
        plan.profile,
        plan.hardware,
        plan.workload,
        Choice(
            Scored(candidate=best.candidate, estimate=best),
            runners_up=others[:4],
            ruled_out=[Scored(candidate=e.candidate, estimate=e) for e in order if not e.fits],
            basis="estimate",
            reasons=[*reasons, *switch_lines],
        ),
        notes=plan.notes,
        timeline=timeline_of(plan, best),
    )


def timeline_of(
    plan: Plan, chosen: MemoryEstimate | None, factors: SpeedFactors | None = None
) -> StepTimeline | None:
    """The ``chosen`` candidate's step as memory over time, on the speed model its prediction
    came from: the plan's, with the ``factors`` a calibration predicted it with (the prior
    where None), so that the timeline's step time is the chosen one's predicted step time (only
    the shown candidate's: the seconds of every candidate's events are not needed). A
    calibrated prediction without its factors has none: it would be a second step time."""
    if chosen is None:
        return None
    calibrated = chosen.speed is not None and chosen.speed.calibrated
    if calibrated and factors is None:
        return None
    return step_profile(plan.speed, chosen, plan.activations, factors, calibrated=calibrated)


def nothing_fits(plan: Plan) -> str:
    """One line: nothing fits the plan's hardware, the closest candidate, and what would fit:
    more nodes (how many), or more host memory where only the host is short."""
    ranked, hw = plan.ranked(), plan.hardware
    host = (
        f" with {format_bytes(hw.host_memory)} of host memory per node"
        if hw.host_memory is not None
        else ""
    )
    closest = f"; closest: {ranked[0].candidate.label()} ({ranked[0].reason})" if ranked else ""
    line = (
        f"no configuration fits {hw.nodes} x {hw.gpus_per_node} GPUs of "
        f"{format_bytes(hw.gpu_memory)}{host} ({len(ranked)} estimated{closest})"
    )
    would = []
    elsewhere = fits_elsewhere(plan) if ranked else None
    if elsewhere is not None:
        nodes, there = elsewhere
        would.append(f"on {nodes} nodes of {hw.gpus_per_node} GPUs ({there.candidate.label()})")
    # short of host memory only: the GPU side fits
    host_short = [
        e for e in ranked if e.headroom >= 0 and hw.host_memory is not None and
        e.host_peak > hw.host_memory
    ]  # fmt: skip
    if host_short:
        least = min(host_short, key=lambda e: e.host_peak)
        would.append(
            f"with {format_bytes(least.host_peak)} of host memory per node "
            f"({least.candidate.label()})"
        )
    if would:
        return f"{line}; it would fit {', or '.join(would)}"
    return f"{line}; add GPUs or nodes, or use a smaller micro-batch or sequence"


def decide_from_trials(
    plan: Plan,
    results: Sequence[TrialResult],
    tried_with: Mapping[str, MemoryEstimate] | None = None,
    factors: Mapping[str, SpeedFactors] | None = None,
) -> Recommendation:
    """The best configuration that ran; every other trial as a runner-up or ruled out.

    ``tried_with``: by candidate label, the estimate each trial was launched with, whose speed
    the calibrated model predicted just before it ran; it replaces the plan's (uncalibrated)
    estimate, so that the report puts each trial against its own prediction. ``factors``: by
    label, the calibrated factors of those predictions, which the chosen one's timeline is
    timed with (:func:`timeline_of`)."""
    tried_with, factors = tried_with or {}, factors or {}
    estimates = [tried_with.get(e.candidate.label(), e) for e in plan.estimates]

    def timeline(chosen: MemoryEstimate | None) -> StepTimeline | None:
        return timeline_of(plan, chosen, factors.get(chosen.candidate.label()) if chosen else None)

    return choose_from_trials(
        plan.profile, plan.hardware, plan.workload, estimates, results, notes=plan.notes,
        timeline=timeline,
    )  # fmt: skip


def choose_from_trials(
    profile: ModelProfile,
    hardware: Hardware,
    workload: WorkloadSpec,
    estimates: Sequence[MemoryEstimate],
    results: Sequence[TrialResult],
    *,
    notes: Sequence[str] = (),
    timeline: Callable[[MemoryEstimate | None], StepTimeline | None] | None = None,
) -> Recommendation:
    """:func:`decide_from_trials` from the plan's parts (what a test or a reader of old results
    has; ``timeline``: the chosen estimate's step as memory over time, :func:`timeline_of`)."""
    if not any(r.status is TrialStatus.OK for r in results):
        raise TrialsFailedError(nothing_ran(results))
    by_label = {e.candidate.label(): e for e in estimates}

    def scored(r: TrialResult) -> Scored:
        return Scored(candidate=r.candidate, estimate=by_label.get(r.candidate.label()), trial=r)

    ok_results = [r for r in results if r.status is TrialStatus.OK]
    predicted = any(predicted_rate(r, by_label) for r in ok_results)
    checked = hardware.host_memory is not None
    if speed_basis(hardware, results) == "model" and predicted:
        ok = rank_by_prediction(results, by_label, host_memory_checked=checked)
        order, _ = _by_prediction(ok, by_label, checked)
        why = explain_by_prediction(ok, order, by_label, hardware, profile)
    else:
        order = ranked(
            [trial_contender(r, hardware.usable_gpu_memory, host_memory_checked=checked)
             for r in ok_results if throughput(r) > 0]
        )  # fmt: skip
        ok = [c.item for c in order]
        why = explain_trials(order, profile)
    return build_recommendation(
        profile,
        hardware,
        workload,
        Choice(
            scored(ok[0]),
            runners_up=[scored(r) for r in ok[1:]],  # all of them: the report lists every trial
            ruled_out=[scored(r) for r in results if r.status is not TrialStatus.OK],
            basis="trials",
            reasons=[*why, *diverged_reason(results)],
        ),
        notes=notes,
        timeline=timeline(by_label.get(ok[0].candidate.label())) if timeline else None,
    )


# --------------------------------------------------------------------------------------------
# CPU trials for GPUs: the trials check, the model ranks
# --------------------------------------------------------------------------------------------


def rank_by_prediction(
    results: Sequence[TrialResult],
    by_label: dict[str, MemoryEstimate],
    *,
    host_memory_checked: bool = False,
) -> list[TrialResult]:
    """Successful trials in the order :func:`decide` puts their estimates (:func:`ranked` on
    the predictions); trials without a prediction last, by measured throughput.

    The headroom is the model's for the planned GPUs, as the speed is: a CPU process's peak is
    not a GPU's (no CUDA context, other kernels), and between two configurations of the same
    memory its resident set differs by noise (the quick start's FULL_SHARD and SHARD_GRAD_OP of
    one unit, 35.4-35.9 MiB each). So the choice is the one :func:`decide` makes without
    trials, among the configurations that ran."""
    order, unpredicted = _by_prediction(results, by_label, host_memory_checked)
    return [c.item for c in order] + unpredicted


def _by_prediction(
    results: Sequence[TrialResult], by_label: dict[str, MemoryEstimate], checked: bool
) -> tuple[list[Contender[TrialResult]], list[TrialResult]]:
    """The successful trials with a prediction as :func:`ranked` orders them (each standing
    for its estimate), and those without, fastest measured first."""
    ok = [r for r in results if r.status is TrialStatus.OK]
    predicted = []
    for r in ok:
        e = by_label.get(r.candidate.label())
        if e is not None and e.speed is not None:
            c = estimate_contender(e, host_memory_checked=checked)
            predicted.append(Contender(r, c.label, c.rate, None, c.headroom, c.usable,
                                       c.offload_unchecked))  # fmt: skip
    unpredicted = sorted(
        (r for r in ok if predicted_rate(r, by_label) is None), key=throughput, reverse=True
    )
    return ranked(predicted), unpredicted


def nothing_ran(results: Sequence[TrialResult]) -> str:
    """One line when no trial ran fine: the commonest failures of the trials that ran first
    (a skipped or pruned candidate's reason repeats them)."""
    from collections import Counter

    from autoshard.study.lessons import advice, signature

    ran = [r for r in results if r.status.launched]
    shown = {signature(r): r for r in ran}
    counts = Counter(signature(r) for r in ran).most_common(2)
    failures = "; ".join(
        f"{n} x {shown[sig].status.value}: {' '.join((shown[sig].error or '').split())[:160]}"
        for sig, n in counts
    )
    rest = len(results) - len(ran)
    if not ran:
        first = " ".join((results[0].error or "").split())[:160] if results else ""
        return f"no configuration could run: all {len(results)} candidates were ruled out" + (
            f" ({first})" if first else ""
        )
    return (
        f"no configuration ran successfully: {len(ran)} trials failed ({failures})"
        + (f", {rest} more candidates ruled out" if rest else "")
        + f"; {advice(ran)}"
    )
