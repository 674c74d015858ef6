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
from importlib.metadata import PackageNotFoundError, version
from typing import TypeVar

import torch

from autoshard.config import Candidate, Checkpointing, Engine, Hardware, Optimizer, WorkloadSpec
from autoshard.errors import ConfigError, TrialsFailedError
from autoshard.measure import (
    compare,
    speed_basis,
    spread_of,
    throughput,
    trials_checked_line,
)
from autoshard.plan import Plan, fits_elsewhere
from autoshard.predict.factors import SpeedFactors
from autoshard.predict.step_profile import step_profile
from autoshard.ranking import (
    PREDICTED_TIE,
    Contender,
    estimate_contender,
    pair_noise,
    ranked,
    speed_key,
    tie,
    trial_contender,
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
from autoshard.space import wrap_reason
from autoshard.switches import proven_switches
from autoshard.units import format_bytes, format_share

T = TypeVar("T")


def versions() -> dict[str, str]:
    """The versions a recommendation was made with (written into every export's header)."""
    out: dict[str, str] = {"torch": str(torch.__version__)}
    for name in ("autoshard", "transformers", "lightning"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def build_recommendation(
    profile: ModelProfile,
    hardware: Hardware,
    workload: WorkloadSpec,
    chosen: Scored,
    *,
    runners_up: Sequence[Scored],
    ruled_out: Sequence[Scored],
    basis: str,
    reasons: Sequence[str],
    notes: Sequence[str] = (),
    timeline: StepTimeline | None = None,
) -> Recommendation:
    """The only place a :class:`Recommendation` is made (``notes``: what the plan assumed;
    ``timeline``: the chosen configuration's step as memory over time)."""
    return Recommendation(
        profile=profile,
        hardware=hardware,
        workload=workload.model_copy(
            update={"micro_batch_size": chosen.candidate.micro_batch_size}
        ),
        chosen=chosen,
        runners_up=tuple(runners_up),
        ruled_out=tuple(ruled_out),
        basis=basis,
        reasons=(*reasons, *host_memory_reason(chosen, hardware), *notes),
        versions=versions(),
        timeline=timeline,
    )


def host_memory_reason(chosen: Scored, hardware: Hardware) -> list[str]:
    """What an offloading choice needs of the host, and whether that was checked."""
    if not chosen.candidate.cpu_offload or chosen.estimate is None:
        return []
    need = format_bytes(chosen.estimate.host_peak)
    if hardware.host_memory is None:
        return [
            f"CPU offload needs {need} of host memory per node (parameters, gradients and "
            "optimizer states of the node's ranks): not checked, no host memory given"
        ]
    return [
        f"CPU offload needs {need} of host memory per node (parameters, gradients and optimizer "
        f"states of the node's ranks), of {format_bytes(hardware.host_memory)}"
    ]


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
            f"gain the model cannot tell from its own error is left out: {_described(best)}"
        ))  # fmt: skip
    others = [Scored(candidate=e.candidate, estimate=e) for e in fitting if e is not best]
    return build_recommendation(
        plan.profile,
        plan.hardware,
        plan.workload,
        Scored(candidate=best.candidate, estimate=best),
        runners_up=others[:4],
        ruled_out=[Scored(candidate=e.candidate, estimate=e) for e in order if not e.fits],
        basis="estimate",
        reasons=[*reasons, *switch_lines],
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
    predicted = any(_predicted_rate(r, by_label) for r in ok_results)
    checked = hardware.host_memory is not None
    if speed_basis(hardware, results) == "model" and predicted:
        ok = rank_by_prediction(results, by_label, host_memory_checked=checked)
        why = explain_by_prediction(ok, by_label, hardware, profile)
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
        scored(ok[0]),
        runners_up=[scored(r) for r in ok[1:]],  # all of them: the report lists every trial
        ruled_out=[scored(r) for r in results if r.status is not TrialStatus.OK],
        basis="trials",
        reasons=[*why, *diverged_reason(results)],
        notes=notes,
        timeline=timeline(by_label.get(ok[0].candidate.label())) if timeline else None,
    )


# --------------------------------------------------------------------------------------------
# The first reason: the rule that decided (autoshard.ranking)
# --------------------------------------------------------------------------------------------


def choice_line(order: Sequence[Contender[T]], what: str, described: str) -> str:
    """The first reason: the rule that put ``order[0]`` first, ``described`` (its rate as the
    reader needs it); ``what``: "measured" or "predicted"."""
    best = order[0]
    n = len(order)
    top = max(order, key=speed_key)
    if top is not best:
        noise = pair_noise(top, best)
        return (
            f"within the noise (±{noise:.0%}) of the fastest {what}, {top.label}, which is "
            f"{top.risk}: chosen as the fastest of {n} {what} configurations without that risk: "
            f"{described}"
        )
    tied = [c for c in order[1:] if tie(best, c)]
    line = f"fastest of {n} {what} configurations: {described}"
    if tied:
        more = "one other" if len(tied) == 1 else f"{len(tied)} others"
        room = (
            f"its headroom ({format_bytes(best.headroom)} of {format_bytes(best.usable)}) is enough"
            if best.usable > 0
            else "headroom does not decide"
        )
        noise = max(pair_noise(best, c) for c in tied)
        line += f"; {more} within the noise (±{noise:.0%}), not preferred for headroom: {room}"
    return line


# --------------------------------------------------------------------------------------------
# Reasons: one line per chosen setting
# --------------------------------------------------------------------------------------------

_SETTINGS = (
    "sharding", "checkpointing", "cpu_offload", "precision", "micro_batch_size", "compile",
    "float8",
)  # fmt: skip
# Explained only where planned: a plan that never proposed them has nothing to say about them.
_SWITCHES = ("compile", "float8")


def _value(candidate: Candidate, name: str) -> str:
    value = getattr(candidate, name)
    if name == "checkpointing" and candidate.checkpointing is Checkpointing.EVERY_K:
        return f"every {candidate.checkpoint_every} blocks"
    if name == "checkpointing" and candidate.checkpointing is Checkpointing.SELECTIVE:
        return "selective (op-level)"
    return str(getattr(value, "value", value))


def _differs_only_in(a: Candidate, b: Candidate, name: str) -> bool:
    related = {
        "sharding": {"sharding", "hybrid_mesh"},
        "checkpointing": {"checkpointing", "checkpoint_every", "checkpoint_classes"},
    }.get(name, {name})
    da, db = a.model_dump(), b.model_dump()
    return da != db and all(da[k] == db[k] for k in da if k not in related)


def _estimate_choice(
    best: MemoryEstimate,
    plan: Plan,
    contender: Callable[[MemoryEstimate], Contender[MemoryEstimate]],
) -> list[str]:
    """The rule that put ``best`` first among the fitting candidates (none where it is not
    first: a reason asked of another candidate)."""
    order = [contender(e) for e in plan.ranked() if e.fits]
    if not order or order[0].item != best or best.speed is None:
        return []
    return [choice_line(order, "predicted", _described(best))]


def _described(e: MemoryEstimate) -> str:
    """A predicted step as the first reason gives it: seconds per step, tokens/s per GPU."""
    if e.speed is None:
        return "no step time predicted"
    tokens = e.speed.tokens_per_s_per_gpu
    return f"{e.speed.step_time_s:.3f} s/step" + (
        f", {tokens:,.0f} tokens/s per GPU" if tokens else ""
    )


def explain_estimate(best: MemoryEstimate, plan: Plan) -> list[str]:
    """Why each setting of ``best``: what its alternatives would need, or cost."""
    c, hardware, profile = best.candidate, plan.hardware, plan.profile
    checked = hardware.host_memory is not None

    def contender(e: MemoryEstimate) -> Contender[MemoryEstimate]:
        return estimate_contender(e, host_memory_checked=checked)

    b = best.breakdown
    lines = [
        f"predicted peak {format_bytes(best.gpu_peak)} per GPU of "
        f"{format_bytes(hardware.usable_gpu_memory)} usable ({hardware.world_size} x "
        f"{format_bytes(hardware.gpu_memory)}, {hardware.margin:.0%} margin): params "
        f"{format_bytes(b.sharded_params)}, grads {format_bytes(b.gradients)}, optimizer "
        f"{format_bytes(b.optimizer)}, gathered units {format_bytes(b.unsharded_params)}, "
        f"activations {format_bytes(b.activations)}, temporaries {format_bytes(b.temporaries)}, "
        f"allowance {format_bytes(b.allowance)}",
        wrap_reason(c, profile),
    ]
    lines[1:1] = _estimate_choice(best, plan, contender)
    if profile.tied:
        names = "; ".join(", ".join(g.names) for g in profile.tied)
        lines.append(f"tied parameters ({names}) stay in one FSDP unit (the root)")
    for name in _SETTINGS:
        if name in _SWITCHES and not any(getattr(e.candidate, name) for e in plan.estimates):
            continue
        alternatives = [e for e in plan.estimates if _differs_only_in(e.candidate, c, name)]
        chosen = _value(c, name)
        too_big = sorted(
            {f"{_value(e.candidate, name)} ({format_bytes(e.gpu_peak)})" for e in alternatives
             if not e.fits}
        )  # fmt: skip
        fitting = [e for e in alternatives if e.fits]
        # Faster than the chosen one yet after it: the tie rule passed over them for a risk.
        at_risk = {
            f"{_value(e.candidate, name)} ({risk})"
            for e in fitting
            if (risk := contender(e).risk) is not None and contender(e).rate > contender(best).rate
        }
        faster = {v.split(" (")[0] for v in at_risk}
        slower = sorted({_value(e.candidate, name) for e in fitting} - faster)
        parts = []
        if too_big:
            parts.append(f"does not fit with {', '.join(too_big)}")
        if slower:
            parts.append(f"fits but predicted slower with {', '.join(slower)}")
        if at_risk:
            parts.append(
                f"predicted within {PREDICTED_TIE:.0%} (a tie) but at risk with "
                f"{', '.join(sorted(at_risk))}"
            )
        why = "; ".join(parts) or (
            "offload is considered with FULL_SHARD only"
            if name == "cpu_offload"
            else "the only value considered (give batch_size to compare others)"
            if name == "micro_batch_size"
            else "the only value considered"
        )
        if name == "checkpointing" and c.checkpoint_classes:
            chosen += f" of {{{', '.join(c.checkpoint_classes)}}}"
        lines.append(f"{name} {chosen}: {why}")
    # the optimizer is the user's (--optimizer); AdamW unless given, and then one of the defaults
    default = c.optimizer is Optimizer.ADAMW
    optimizer = f"{c.optimizer.value} ({c.optimizer_impl.value})"
    if c.engine is Engine.FSDP2:  # fully_shard has no limit_all_gathers or backward_prefetch
        lines.append(
            "fully_shard's own prefetching (the next unit's all-gather issued ahead on its own "
            "stream, forward and backward)" + (f", {optimizer}" if default else "") + ": "
            "the defaults; the optimizer's implementation changes speed a little; measure it "
            "with trials"
        )
    else:
        lines.append(
            f"limit_all_gathers={c.limit_all_gathers}, forward_prefetch={c.forward_prefetch}, "
            f"backward_prefetch={c.backward_prefetch.value}"
            + (f", {optimizer}" if default else "")
            + ": Lightning's defaults; they change speed a little, memory by at most one unit; "
            "measure them with trials"
        )
    if not default:
        lines.append(f"{optimizer}: the optimizer given (--optimizer / optimizer=), planned as is")
    lines.append(
        "basis: estimates only (no trial ran); run with trials to measure the leading candidates"
    )
    return lines


def _differences(chosen: Candidate, other: Candidate) -> list[str]:
    """The explained settings in which ``other`` differs from ``chosen``, as name=value."""
    diff = [
        f"{name}={_value(other, name)}"
        for name in _SETTINGS
        if getattr(other, name) != getattr(chosen, name)
    ]
    if (other.wrap_classes, other.min_num_params) != (chosen.wrap_classes, chosen.min_num_params):
        # in the engine's own terms: FSDP2 has no auto_wrap_policy, it shards chosen modules
        units = "fully_shard units" if other.engine is Engine.FSDP2 else "auto_wrap_policy"
        diff.append(
            f"{units}="
            + (
                "none (one unit)"
                if other.one_unit
                else ",".join(c.rsplit(".", 1)[-1] for c in other.wrap_classes)
                or f"size>={other.min_num_params:,}"
            )
        )
    return diff


def explain_trials(order: Sequence[Contender[TrialResult]], profile: ModelProfile) -> list[str]:
    """One line per chosen setting, with the measurement behind it, ``order`` the trials as
    :func:`ranked` put them. A difference within the two trials' noise is called a tie, never
    a win (:func:`autoshard.measure.compare`)."""
    best = order[0].item
    c = best.candidate
    unit = "tokens" if best.tokens_per_s else "samples"
    measured = (
        f"{best.step_time or 0:.3f} s/step (±{spread_of(best):.0%}), {throughput(best):,.0f} "
        f"{unit}/s on {best.world_size} {best.device} ranks"
    )
    lines = [choice_line(order, "measured", measured), wrap_reason(c, profile)]
    for r in (x.item for x in order[1:]):
        diff = _differences(c, r.candidate)
        if len(diff) != 1:
            continue
        outcome = compare(best, r)
        if outcome.tie:
            lines.append(f"{diff[0]}: tie within noise (±{outcome.noise:.0%})")
        elif throughput(best) > throughput(r):
            lines.append(f"{diff[0]} measured {outcome.ratio:.2f}x slower")
    return lines


# --------------------------------------------------------------------------------------------
# CPU trials for GPUs: the trials check, the model ranks
# --------------------------------------------------------------------------------------------


def _predicted_rate(r: TrialResult, by_label: dict[str, MemoryEstimate]) -> float | None:
    e = by_label.get(r.candidate.label())
    return e.speed.samples_per_s if e is not None and e.speed is not None else None


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
        (r for r in ok if _predicted_rate(r, by_label) is None), key=throughput, reverse=True
    )
    return ranked(predicted), unpredicted


def explain_by_prediction(
    ok: Sequence[TrialResult],
    by_label: dict[str, MemoryEstimate],
    hardware: Hardware,
    profile: ModelProfile,
) -> list[str]:
    """Why the chosen one, when CPU trials checked the configurations and the model ranked."""
    best = ok[0]
    rate = _predicted_rate(best, by_label)
    speed = by_label[best.candidate.label()].speed if rate is not None else None
    lines = [trials_checked_line(hardware, speed.gpu if speed else None)]
    if speed is not None:
        per_gpu = (
            f", {speed.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
            if speed.tokens_per_s_per_gpu
            else ""
        )
        mfu = f", MFU {format_share(speed.mfu)}" if speed.mfu else ""
        predicted = f"{speed.step_time_s:.3f} s/step{per_gpu}{mfu}"
        order, _ = _by_prediction(ok, by_label, hardware.host_memory is not None)
        lines.append(choice_line(order, "predicted", predicted))
    lines.append(wrap_reason(best.candidate, profile))
    checked = hardware.host_memory is not None
    for r in ok[1:]:
        diff = _differences(best.candidate, r.candidate)
        other = _predicted_rate(r, by_label)
        if len(diff) == 1 and rate and other:
            ratio = rate / other
            risk = estimate_contender(by_label[r.candidate.label()], host_memory_checked=checked)
            # A model's few-percent difference is no result: say "about as fast", not "1.00x".
            if ratio >= 1 + PREDICTED_TIE:
                lines.append(f"{diff[0]} predicted {ratio:.2f}x slower")
            elif ratio < 1 and risk.risk is not None:
                lines.append(
                    f"{diff[0]} predicted about as fast (within {PREDICTED_TIE:.0%}), but "
                    f"{risk.risk}"
                )
            else:
                lines.append(f"{diff[0]} predicted about as fast (within {PREDICTED_TIE:.0%})")
    return lines


def diverged_reason(results: Sequence[TrialResult]) -> list[str]:
    """One line naming the trials whose loss became NaN or infinite: none of them is
    recommended, and their configuration is rarely why."""
    diverged = [r for r in results if r.status is TrialStatus.DIVERGED]
    if not diverged:
        return []
    named = "; ".join(f"{r.candidate.label()} ({r.error or 'loss not finite'})" for r in diverged)
    return [
        f"{len(diverged)} diverged, not recommended: {named}. The model's training step (its "
        "learning rate, loss scaling, an fp16 overflow), not the configuration, is usually why: "
        "check the step before trusting any choice"
    ]


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
