"""Reports of a :class:`~autoshard.results.Decision`: the rich terminal summary and
``report.json`` (stable for scripts). Files are written by :mod:`autoshard.ui.files`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from autoshard.config import Candidate, Engine, Hardware
from autoshard.emit.prose import describe_fsdp2_precision, describe_reshard
from autoshard.measure import speed_basis, spread_of, trials_checked_line
from autoshard.outcomes import OUTCOMES, TrialStatus, outcome_of
from autoshard.results import Decision, Scored, SpeedBreakdown, TrialResult
from autoshard.ui.fit import Column, fitted_table
from autoshard.units import format_bytes

SCHEMA = "autoshard.report/1"

# One colour per MemoryBreakdown term, in stacking order.
KIND_COLOURS: dict[str, str] = {
    "sharded_params": "#4e79a7",
    "unsharded_params": "#a0cbe8",
    "gradients": "#f28e2b",
    "optimizer": "#ffbe7d",
    "comm_buffers": "#59a14f",
    "activations": "#e15759",
    "temporaries": "#ff9d9a",
    "buffers": "#b07aa1",
    "allowance": "#bab0ac",
}
# What became of a candidate: the words, colours and marks of outcomes.OUTCOMES, which every view
# keeps apart (measured; diverged: ran every step, the loss became NaN or infinite; failed: ran,
# and ended in an OOM, an error or a timeout; skipped and ruled out: never launched, a failure or
# the workers, or the estimate, kept them out).
MEASURED, DIVERGED, FAILED, SKIPPED, RULED_OUT = (o.word for o in OUTCOMES)
OUTCOME_BY_WORD = {o.word: o for o in OUTCOMES}
NEVER_LAUNCHED = {
    status: o.word for o in OUTCOMES for status in o.statuses if not status.launched
}  # fmt: skip


def outcome(s: Scored) -> str | None:
    """Which outcome (:data:`autoshard.outcomes.OUTCOMES`) befell ``s``; None for a candidate
    that fits and was never tried (an estimate-only decision's runners-up)."""
    t = s.trial
    if t is None:
        return RULED_OUT if s.estimate is not None and not s.estimate.fits else None
    return outcome_of(t.status).word


NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def reason_key(text: str) -> str:
    """A reason with its numbers blanked: "needs 80.1 GiB per GPU" and "needs 133 GiB per GPU"
    are one reason, said once with how many share it."""
    return NUMBER.sub("#", " ".join(text.split()))


def grouped_reasons(reasons: Iterable[str]) -> dict[str, int]:
    """Each distinct reason (numbers aside, :func:`reason_key`) with how many candidates share
    it, the most shared first; a number that differs among them is given as its range.

    >>> grouped_reasons(["needs 80 GiB of 76", "offload needs a GPU", "needs 133 GiB of 76"])
    {'needs 80-133 GiB of 76': 2, 'offload needs a GPU': 1}
    """
    return {text: n for _, text, n in _reason_groups(reasons)}


def _reason_groups(reasons: Iterable[str]) -> list[tuple[str, str, int]]:
    """(key, the reason with its varying numbers as ranges, how many) per distinct reason."""
    numbers: dict[str, list[list[str]]] = {}
    for text in reasons:
        flat = " ".join(text.split())
        numbers.setdefault(reason_key(flat), []).append(NUMBER.findall(flat))
    out = []
    for key, seen in sorted(numbers.items(), key=lambda kv: -len(kv[1])):
        spans = []
        for values in zip(*seen, strict=True):
            low = min(values, key=lambda v: float(v.replace(",", "")))
            high = max(values, key=lambda v: float(v.replace(",", "")))
            spans.append(low if low == high else f"{low}-{high}")
        parts = key.split("#")
        text = "".join(p + (spans[i] if i < len(spans) else "") for i, p in enumerate(parts))
        out.append((key, text, len(seen)))
    return out


def never_launched(s: Scored) -> tuple[str, str] | None:
    """(outcome, reason) of a candidate never launched: skipped, or ruled out (predicted not to
    fit, as a trial record or an estimate); None for one that ran or fits."""
    t = s.trial
    if t is not None and not t.status.launched:
        return NEVER_LAUNCHED[t.status], t.error or ""
    if t is None and s.estimate is not None and not s.estimate.fits:
        return RULED_OUT, s.estimate.reason
    return None


def group_line(word: str, n: int, why: str) -> str:
    """One line for ``n`` candidates never launched for one reason, in the outcome's word.

    >>> group_line("skipped", 32, "offload needs a GPU")
    '32 skipped, never launched: offload needs a GPU'
    """
    return f"{n} {word}, never launched: {why}"


def never_launched_groups(
    rows: Iterable[tuple[str, Scored]],
) -> list[tuple[str, int, str, list[str]]]:
    """The candidates of ``rows`` never launched, as (outcome, how many, the reason they share:
    :func:`grouped_reasons`, their labels): one line each in the terminal and report.html's
    table, instead of a row per candidate with the same reason."""
    by_word: dict[str, list[tuple[str, str]]] = {}
    for _, s in rows:
        if (kept := never_launched(s)) is not None:
            by_word.setdefault(kept[0], []).append((kept[1], s.candidate.label()))
    out = []
    for word, kept_out in by_word.items():
        for key, why, n in _reason_groups(reason for reason, _ in kept_out):
            labels = [label for reason, label in kept_out if reason_key(reason) == key]
            out.append((word, n, why, labels))
    return out


def outcome_counts(rec: Decision, trials: Iterable[TrialResult] = ()) -> dict[str, int]:
    """How many candidates ended each way (report.json, the throughput chart): the trials
    given and every candidate the recommendation lists."""
    counts = {o.word: 0 for o in OUTCOMES}
    for _, s in listed_rows(rec, trials):
        if (kind := outcome(s)) is not None:
            counts[kind] += 1
    return counts


def scored_rows(rec: Decision) -> list[tuple[str, Scored]]:
    """The recommendation's candidates, each with what it is to the decision: chosen,
    runner-up, or what kept it out (failed, skipped, ruled out)."""
    return [
        ("chosen", rec.chosen),
        *(("runner-up", s) for s in rec.runners_up),
        *((outcome(s) or "not chosen", s) for s in rec.ruled_out),
    ]


def listed_rows(rec: Decision, trials: Iterable[TrialResult] = ()) -> list[tuple[str, Scored]]:
    """Every candidate of the recommendation, then every trial it does not carry (a
    recommendation that kept only some runners-up still gets all its trials listed)."""
    rows = scored_rows(rec)
    listed = {s.candidate.key() for _, s in rows}
    for t in trials:
        if t.candidate.key() not in listed:
            scored = Scored(candidate=t.candidate, trial=t)
            rows.append((outcome(scored) or MEASURED, scored))
            listed.add(t.candidate.key())
    return rows


def trials_of(rec: Decision, trials: Iterable[TrialResult]) -> list[TrialResult]:
    """The trials given, or those the recommendation carries."""
    given = list(trials)
    if given:
        return given
    return [s.trial for _, s in scored_rows(rec) if s.trial is not None]


def trial_rate(t: TrialResult | None) -> tuple[float | None, str]:
    if t is None:
        return None, ""
    if t.tokens_per_s:
        return t.tokens_per_s, "tokens/s"
    return t.samples_per_s, "samples/s"


def rate_per_rank(t: TrialResult | None) -> tuple[float | None, str]:
    """The trial's measured tokens/s (else samples/s) of one rank: its ``*_per_gpu``."""
    if t is None or t.status is not TrialStatus.OK:
        return None, trial_rate(t)[1]
    if t.tokens_per_s_per_gpu:
        return t.tokens_per_s_per_gpu, "tokens/s"
    return t.samples_per_s_per_gpu, "samples/s"


def predicted_per_rank(s: Scored, hardware: Hardware) -> tuple[float | None, str]:
    """The step-time model's tokens/s (else samples/s) of one GPU, when it predicted one."""
    speed = s.estimate.speed if s.estimate is not None else None
    if speed is None:
        return None, ""
    if speed.tokens_per_s_per_gpu:
        return speed.tokens_per_s_per_gpu, "tokens/s"
    return speed.samples_per_s / hardware.world_size, "samples/s"


def prediction_error(s: Scored, hardware: Hardware) -> float | None:
    """Predicted over measured throughput, minus one, where both are of the same device (the
    trial ran where the prediction is for): +0.12 means the model was 12% optimistic."""
    if s.trial is None or speed_basis(hardware, [s.trial]) == "model":
        return None
    predicted, p_unit = predicted_per_rank(s, hardware)
    measured, m_unit = rate_per_rank(s.trial)
    if predicted is None or not measured or p_unit != m_unit:
        return None
    return predicted / measured - 1


def error_text(s: Scored, error: float, rows: Iterable[tuple[str, Scored]]) -> str:
    """The model's error as every view writes it: ``model +12%``, and ``uncalibrated`` where
    this prediction was made before any trial calibrated the model while others were after
    (SpeedEstimate.calibrated): not a peer of the calibrated ones."""
    text = f"model {error:+.0%}"
    speed = s.estimate.speed if s.estimate else None
    others = [o.estimate.speed for _, o in rows if o.estimate and o.estimate.speed]
    if speed is not None and not speed.calibrated and any(o.calibrated for o in others):
        text += ", uncalibrated"
    return text


def predicted_device(rec: Decision) -> str:
    """What the predictions are for: the catalogue id they name, or the planned hardware's."""
    return predicted_device_of([s for _, s in scored_rows(rec)], rec.hardware)


def predicted_device_of(scored: Iterable[Scored], hardware: Hardware) -> str:
    """:func:`predicted_device` of any candidates (a study in which nothing ran has no
    recommendation)."""
    for s in scored:
        if s.estimate is not None and s.estimate.speed is not None and s.estimate.speed.gpu:
            return s.estimate.speed.gpu
    return hardware.gpu or ("cpu-gloo" if hardware.backend == "gloo" else "GPU")


def trials_note(rec: Decision, trials: Sequence[TrialResult] = ()) -> str | None:
    """The line that says CPU trials checked the configurations while the model ranked them
    for the planned GPUs; None when the trials ran on what is planned for."""
    ran = trials_of(rec, trials)
    if rec.basis != "trials" or speed_basis(rec.hardware, ran) != "model":
        return None
    if not any(s.estimate and s.estimate.speed for _, s in scored_rows(rec)):
        return None  # no predictions: the measured order decided after all
    return trials_checked_line(rec.hardware, predicted_device(rec))


def why_ruled_out(s: Scored) -> str:
    """What kept ``s`` out, saying which of the four it was: ``failed (oom): ...``, ``skipped,
    never launched: ...``, ``predicted not to fit, never launched: ...``."""
    t = s.trial
    if t is not None and t.status is not TrialStatus.OK:
        row = outcome_of(t.status)
        said = f"{row.says} ({t.status.value})" if t.status.launched else row.says
        return f"{said}: {t.error}" if t.error else said
    if s.estimate is not None and not s.estimate.fits:
        return "predicted not to fit: " + (
            s.estimate.reason
            or f"predicted {format_bytes(s.estimate.gpu_peak)} per rank does not fit"
        )
    return "slower"


# ---------------------------------------------------------------------------------------------
# Terminal
# ---------------------------------------------------------------------------------------------


def print_summary(
    rec: Decision, console: Console | None = None, trials: Sequence[TrialResult] = ()
) -> None:
    """The chosen configuration, why it won, every trial with its predicted and measured
    speed, and what was ruled out and why."""
    from autoshard.emit.prose import choose_state_dict_type

    console = console or Console()
    c = rec.chosen.candidate
    console.print(f"[bold green]Recommended[/] ({rec.basis}): [bold]{c.label()}[/]")
    note = trials_note(rec, trials)
    if note and note not in rec.reasons:
        console.print(f"[yellow]{note}[/]", highlight=False)
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column()
    for key, value in settings_of(rec).items():
        table.add_row(key, value)
    console.print(table)
    console.print("[bold]Why[/]")
    for line in (*rec.reasons, choose_state_dict_type(rec)[1]):
        console.print(f"  • {escape(line)}", highlight=False)
    rows = listed_rows(rec, trials)
    if len(rows) > 1:
        groups = never_launched_groups(rows)
        rows = [(k, s) for k, s in rows if never_launched(s) is None]
        ran = {s.trial.device for _, s in rows if s.trial and s.trial.status is TrialStatus.OK}
        where = f" ({next(iter(ran))})" if len(ran) == 1 else ""
        unit = next((u for _, s in rows for u in [rate_per_rank(s.trial)[1]] if u), "tokens/s")
        per = "per GPU" if ran == {"cuda"} else "per rank"
        columns = [
            Column("", keep=7), Column("configuration", keep=9, wrap=True),
            Column("predicted peak", "right", keep=4),
            Column(f"measured peak{where}", "right", keep=6),
            Column(f"predicted {unit} per GPU ({predicted_device(rec)})", "right", keep=5),
            Column(f"measured {unit} {per}{where}", "right", keep=8),
            Column("why not", keep=8, wrap=True),
        ]  # fmt: skip
        cells = []
        for kind, s in rows:
            predicted, _ = predicted_per_rank(s, rec.hardware)
            measured, _ = rate_per_rank(s.trial)
            error = prediction_error(s, rec.hardware)
            ok = s.trial is not None and s.trial.status is TrialStatus.OK
            measured_text = ""
            if measured is not None and s.trial is not None:
                measured_text = f"{measured:,.0f} ±{spread_of(s.trial):.0%}"
                if error is not None:
                    measured_text += f" ({error_text(s, error, rows)})"
            cells.append([
                kind,
                s.candidate.label(),
                format_bytes(s.estimate.gpu_peak) if s.estimate else "",
                format_bytes(s.trial.max_allocated) if s.trial and s.trial.max_allocated else "",
                f"{predicted:,.0f}" if predicted else "",
                measured_text,
                "" if ok or kind == "chosen" else escape(why_ruled_out(s)),
            ])  # fmt: skip
        console.print(
            fitted_table(
                columns,
                cells,
                console.width,
                title="Configurations",
                title_justify="left",
                caption_justify="left",
            )
        )
        for word, n, why, _ in groups:
            console.print(escape(group_line(word, n, why)), highlight=False)
    n = sum(1 for t in trials_of(rec, trials) if t.status.launched)
    if n:
        console.print(f"[dim]{n} trials ran; see report.html for charts[/]")


def summary_renderable(rec: Decision) -> Group:
    """A short rich rendering (notebooks, ``rich.print(rec)``): the choice and its settings."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column()
    for key, value in settings_of(rec).items():
        table.add_row(key, value)
    head = Text.from_markup(
        f"[bold green]Recommended[/] ({rec.basis}): [bold]{rec.chosen.candidate.label()}[/]"
    )
    return Group(head, table)


def settings_of(rec: Decision) -> dict[str, str]:
    """The chosen settings, each under the name the chosen engine gives it: FSDP1's
    ``FullyShardedDataParallel`` arguments, or FSDP2's ``fully_shard`` units and policies (which
    have no ``limit_all_gathers`` or ``backward_prefetch``)."""
    c = rec.chosen.candidate
    mesh = f" mesh {c.hybrid_mesh[0]}x{c.hybrid_mesh[1]}" if c.hybrid_mesh else ""
    checkpointing = (
        c.checkpointing.value
        + (f" (1 in {c.checkpoint_every})" if c.checkpointing.value == "every_k" else "")
        + (
            " (op-level: matmuls, every other one, and attention kept)"
            if c.checkpointing.value == "selective"
            else ""
        )
        + (f" of {', '.join(c.checkpoint_classes)}" if c.checkpoint_classes else "")
    )
    out: dict[str, str]
    if c.engine is Engine.FSDP2:
        units = ", ".join(c.wrap_classes)
        out = {
            "engine": "fsdp2 (fully_shard)",
            "fully_shard units": f"each {units}, then the root"
            if units
            else "the whole model as one unit (the root)",
            "sharding": c.sharding.value + mesh,
            "reshard_after_forward": describe_reshard(c),
            "precision": c.precision.value
            + (f" ({policy})" if (policy := describe_fsdp2_precision(c)) else ""),
            "activation checkpointing": checkpointing,
            "offload_policy": "CPUOffloadPolicy()" if c.cpu_offload else "none",
        }
    else:
        out = {
            "engine": c.engine.value,
            "auto_wrap_policy": ", ".join(c.wrap_classes)
            or (f"size >= {c.min_num_params:,} params" if c.min_num_params else "none"),
            "sharding_strategy": c.sharding.value + mesh,
            "precision": c.precision.value,
            "activation checkpointing": checkpointing,
            "cpu_offload": str(c.cpu_offload),
            "limit_all_gathers / forward_prefetch": (
                f"{c.limit_all_gathers} / {c.forward_prefetch}"
            ),
            "backward_prefetch": c.backward_prefetch.value,
        }
    out.update(
        {
            "gradients reduced in": reduce_dtype_of(c),
            "optimizer": f"{c.optimizer.value} ({c.optimizer_impl.value})",
            "micro_batch_size": str(c.micro_batch_size),
            "devices x nodes": f"{rec.hardware.gpus_per_node} x {rec.hardware.nodes}",
        }
    )
    estimate = rec.chosen.estimate
    if estimate:
        out["predicted peak / rank"] = (
            f"{format_bytes(estimate.gpu_peak)} of "
            f"{format_bytes(rec.hardware.usable_gpu_memory)} usable"
        )
        if estimate.breakdown.allowance:
            # Said here because CPU trials measure without it: 1 GiB predicted beside 80 MiB
            # measured reads as a broken estimator otherwise.
            out["predicted peak / rank"] += (
                f", {format_bytes(estimate.breakdown.allowance)} of it the allowance for "
                "the CUDA context, NCCL and allocator slack"
            )
    if estimate and estimate.speed:
        out["predicted step"] = speed_terms(estimate.speed.breakdown, estimate.speed.step_time_s)
    t = rec.chosen.trial
    if t is not None and t.step_time is not None:
        rate, unit = rate_per_rank(t)
        ranks = f" ({t.world_size} ranks)" if t.world_size > 1 else ""
        out["measured"] = f"{t.step_time:.3f} s/step" + (
            f", {rate:,.0f} {unit} {t.per_gpu}{ranks}" if rate else ""
        )
        if t.max_allocated:
            out["measured"] += f", peak {format_bytes(t.max_allocated)} per rank on {t.device}"
    return out


def reduce_dtype_of(c: Candidate) -> str:
    """The dtype gradients are reduced in, read from the candidate (``reduce_dtype_fp32``, which
    FSDP1's and FSDP2's kwargs apply): fp32 under mixed precision where it says so, else the
    compute dtype.

    >>> from autoshard import Candidate
    >>> reduce_dtype_of(Candidate()), reduce_dtype_of(Candidate(engine="fsdp2"))
    ('bf16', 'fp32')
    """
    if c.precision.mixed and c.reduce_dtype_fp32:
        return "fp32"
    value = c.precision.value
    return "bf16" if value.startswith("bf16") else "fp16" if value.startswith("16") else "fp32"


def measured_of(rec: Decision) -> dict[str, Any] | None:
    """The chosen configuration's measurement in report.json, each number in the unit every
    view shows it in (one rank's: per GPU); None where no trial ran."""
    t = rec.chosen.trial
    if t is None or t.step_time is None:
        return None
    return {
        "step_time_s": t.step_time,
        "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
        "samples_per_s_per_gpu": t.samples_per_s_per_gpu,
        "peak_allocated_per_gpu": t.max_allocated,
        "device": t.device,
        "ranks": t.world_size,
    }


def speed_terms(b: SpeedBreakdown, step_time_s: float) -> str:
    """The predicted step and its non-zero terms, the compile and float8 ones included
    ("saved": taken out of compute and recompute already).

    >>> from autoshard.results import SpeedBreakdown
    >>> speed_terms(SpeedBreakdown(compute_s=1.0, compile_saving_s=0.1), 1.0)
    '1.000 s: compute 1.000 s; torch.compile saved 0.100 s'
    """
    names = {
        "compute_s": "compute", "recompute_s": "recompute", "exposed_comm_s": "exposed comm",
        "contention_s": "contention", "offload_s": "offload", "optimizer_s": "optimizer",
        "float8_scale_sync_s": "float8 scales", "compile_saving_s": "torch.compile saved",
        "float8_matmul_saving_s": "float8 matmuls saved",
        "float8_cast_s": "float8 casts (in compute)", "host_bound_s": "host-bound",
    }  # fmt: skip
    terms = [f"{names.get(k, k)} {v:.3f} s" for k, v in b.model_dump().items() if v]
    return f"{step_time_s:.3f} s: " + "; ".join(terms)


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def report_data(rec: Decision, trials: Sequence[TrialResult] = ()) -> dict[str, Any]:
    """Everything, for scripts. Keys are only ever added under one schema version."""
    from autoshard.emit.prose import choose_state_dict_type

    kind, why = choose_state_dict_type(rec)
    # through pydantic's JSON: a diverged trial's NaN losses become "NaN", not JSON's missing NaN
    return {
        "schema": SCHEMA,
        "recommendation": json.loads(rec.model_dump_json()),
        "trials": [json.loads(t.model_dump_json()) for t in trials_of(rec, trials)],
        "summary": {
            "label": rec.chosen.candidate.label(),
            # measured, failed (ran: oom/error/timeout), skipped and ruled out (never launched)
            "outcomes": outcome_counts(rec, trials_of(rec, trials)),
            "basis": rec.basis,
            "settings": settings_of(rec),
            "measured": measured_of(rec),
            "state_dict_type": kind,
            "state_dict_reason": why,
        },
    }


def failure_data(hardware: Hardware, rows: list[tuple[str, Scored]], error: str) -> dict[str, Any]:
    """report.json of a study in which no configuration ran: no recommendation, the one line
    that says why, every trial, the outcomes counted in the same words."""
    counts = {o.word: 0 for o in OUTCOMES}
    for _, s in rows:
        if (kind := outcome(s)) is not None:
            counts[kind] += 1
    return {
        "schema": SCHEMA,
        "recommendation": None,
        "error": error,
        "trials": [s.trial.model_dump(mode="json") for _, s in rows if s.trial is not None],
        "summary": {
            "outcomes": counts,
            "basis": None,
            "hardware": hardware.model_dump(mode="json"),
        },
    }


__all__ = [
    "SCHEMA",
    "failure_data",
    "print_summary",
    "report_data",
]
