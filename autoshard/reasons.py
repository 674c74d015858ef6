"""Why a decision chose what it chose, one line per reason: the rule that put it first
(:func:`choice_line`), then one line per setting with what its alternatives would need or cost,
from estimates (:func:`explain_estimate`), from measured trials (:func:`explain_trials`) or from
CPU trials ranked by the step-time model (:func:`explain_by_prediction`); and what an offloading
choice needs of the host, and the trials that diverged. :mod:`autoshard.decide` decides; this
module only words it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from autoshard.config import Candidate, Checkpointing, Engine, Hardware, Optimizer
from autoshard.measure import compare, spread_of, throughput, trials_checked_line
from autoshard.plan import Plan
from autoshard.ranking import (
    PREDICTED_TIE,
    Contender,
    estimate_contender,
    pair_noise,
    speed_key,
    tie,
)
from autoshard.results import MemoryEstimate, ModelProfile, Scored, TrialResult, TrialStatus
from autoshard.space import wrap_reason
from autoshard.units import format_bytes, format_share

T = TypeVar("T")


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
    return [choice_line(order, "predicted", described(best))]


def described(e: MemoryEstimate) -> str:
    """A predicted step as the first reason gives it: seconds per step, tokens/s per GPU."""
    if e.speed is None:
        return "no step time predicted"
    tokens = e.speed.tokens_per_s_per_gpu
    return f"{e.speed.step_time_s:.3f} s/step" + (
        f", {tokens:,.0f} tokens/s per GPU" if tokens else ""
    )


def _defaults_lines(c: Candidate) -> list[str]:
    """The settings left at the stack's defaults (prefetching, the optimizer's implementation),
    and the optimizer where the user gave one."""
    lines: list[str] = []
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
    return lines


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
    lines += _defaults_lines(c)
    lines.append(
        "basis: estimates only (no trial ran); run with trials to measure the leading candidates"
    )
    return lines


def differences(chosen: Candidate, other: Candidate) -> list[str]:
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
        diff = differences(c, r.candidate)
        if len(diff) != 1:
            continue
        outcome = compare(best, r)
        if outcome.tie:
            lines.append(f"{diff[0]}: tie within noise (±{outcome.noise:.0%})")
        elif throughput(best) > throughput(r):
            lines.append(f"{diff[0]} measured {outcome.ratio:.2f}x slower")
    return lines


def predicted_rate(r: TrialResult, by_label: dict[str, MemoryEstimate]) -> float | None:
    e = by_label.get(r.candidate.label())
    return e.speed.samples_per_s if e is not None and e.speed is not None else None


def explain_by_prediction(
    ok: Sequence[TrialResult],
    order: Sequence[Contender[TrialResult]],
    by_label: dict[str, MemoryEstimate],
    hardware: Hardware,
    profile: ModelProfile,
) -> list[str]:
    """Why the chosen one, when CPU trials checked the configurations and the model ranked
    (``order``: those of ``ok`` with a prediction, as :func:`autoshard.ranking.ranked` put
    them)."""
    best = ok[0]
    rate = predicted_rate(best, by_label)
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
        lines.append(choice_line(order, "predicted", predicted))
    lines.append(wrap_reason(best.candidate, profile))
    checked = hardware.host_memory is not None
    for r in ok[1:]:
        diff = differences(best.candidate, r.candidate)
        other = predicted_rate(r, by_label)
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
