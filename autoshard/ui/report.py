"""Reports of a :class:`~autoshard.results.Recommendation`: the rich terminal summary and
``report.json`` (stable for scripts). Files are written and read back by :mod:`autoshard.ui.files`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from autoshard.results import Recommendation, Scored, TrialResult, TrialStatus
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
STATUS_COLOURS = {
    TrialStatus.OK: "#2e7d32",
    TrialStatus.OOM: "#e65100",
    TrialStatus.ERROR: "#c62828",
    TrialStatus.TIMEOUT: "#c62828",
    TrialStatus.PRUNED: "#757575",
    TrialStatus.SKIPPED: "#9e9e9e",
}


def scored_rows(rec: Recommendation) -> list[tuple[str, Scored]]:
    return [
        ("chosen", rec.chosen),
        *(("runner-up", s) for s in rec.runners_up),
        *(("ruled out", s) for s in rec.ruled_out),
    ]


def trials_of(rec: Recommendation, trials: Iterable[TrialResult]) -> list[TrialResult]:
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


def why_ruled_out(s: Scored) -> str:
    if s.trial is not None and s.trial.status is not TrialStatus.OK:
        return f"{s.trial.status.value}: {s.trial.error or ''}".strip(": ")
    if s.estimate is not None and not s.estimate.fits:
        return s.estimate.reason or (
            f"predicted {format_bytes(s.estimate.gpu_peak)} per rank does not fit"
        )
    return "slower"


# ---------------------------------------------------------------------------------------------
# Terminal
# ---------------------------------------------------------------------------------------------


def print_summary(
    rec: Recommendation, console: Console | None = None, trials: Sequence[TrialResult] = ()
) -> None:
    """The chosen configuration, why it won, the runners-up, and what was ruled out and why."""
    from autoshard.emit.runtime import choose_state_dict_type

    console = console or Console()
    c = rec.chosen.candidate
    console.print(f"[bold green]Recommended[/] ({rec.basis}): [bold]{c.label()}[/]")
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column()
    for key, value in settings_of(rec).items():
        table.add_row(key, value)
    console.print(table)
    console.print("[bold]Why[/]")
    for line in (*rec.reasons, choose_state_dict_type(rec)[1]):
        console.print(f"  • {line}", highlight=False)
    rows = [("runner-up", s) for s in rec.runners_up] + [("ruled out", s) for s in rec.ruled_out]
    if rows:
        alt = Table(title="Alternatives", title_justify="left")
        devices = {s.trial.device for _, s in rows if s.trial and s.trial.max_allocated}
        measured = f"measured ({devices.pop()})" if len(devices) == 1 else "measured"
        for col in ("", "configuration", "predicted", measured, "speed / why not"):
            alt.add_column(col)
        for kind, s in rows:
            rate, unit = trial_rate(s.trial)
            ok = s.trial is not None and s.trial.status is TrialStatus.OK
            note = f"{rate:,.0f} {unit}" if ok and rate else why_ruled_out(s)
            alt.add_row(
                kind,
                s.candidate.label(),
                format_bytes(s.estimate.gpu_peak) if s.estimate else "",
                format_bytes(s.trial.max_allocated) if s.trial and s.trial.max_allocated else "",
                note[:80],
            )
        console.print(alt)
    n = sum(1 for t in trials_of(rec, trials) if t.status.launched)
    if n:
        console.print(f"[dim]{n} trials ran; see report.html for charts[/]")


def settings_of(rec: Recommendation) -> dict[str, str]:
    c = rec.chosen.candidate
    out = {
        "engine": c.engine.value,
        "auto_wrap_policy": ", ".join(c.wrap_classes)
        or (f"size >= {c.min_num_params:,} params" if c.min_num_params else "none"),
        "sharding_strategy": c.sharding.value
        + (f" mesh {c.hybrid_mesh[0]}x{c.hybrid_mesh[1]}" if c.hybrid_mesh else ""),
        "precision": c.precision.value,
        "activation checkpointing": c.checkpointing.value
        + (f" (1 in {c.checkpoint_every})" if c.checkpointing.value == "every_k" else "")
        + (f" of {', '.join(c.checkpoint_classes)}" if c.checkpoint_classes else ""),
        "cpu_offload": str(c.cpu_offload),
        "limit_all_gathers / forward_prefetch": f"{c.limit_all_gathers} / {c.forward_prefetch}",
        "backward_prefetch": c.backward_prefetch.value,
        "optimizer": f"{c.optimizer.value} ({c.optimizer_impl.value})",
        "micro_batch_size": str(c.micro_batch_size),
        "devices x nodes": f"{rec.hardware.gpus_per_node} x {rec.hardware.nodes}",
    }
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
    t = rec.chosen.trial
    if t is not None and t.step_time is not None:
        rate, unit = trial_rate(t)
        out["measured"] = f"{t.step_time:.3f} s/step" + (f", {rate:,.0f} {unit}" if rate else "")
        if t.max_allocated:
            out["measured"] += f", peak {format_bytes(t.max_allocated)} on {t.device}"
    return out


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def report_data(rec: Recommendation, trials: Sequence[TrialResult] = ()) -> dict[str, Any]:
    """Everything, for scripts. Keys are only ever added under one schema version."""
    from autoshard.emit.runtime import choose_state_dict_type

    kind, why = choose_state_dict_type(rec)
    return {
        "schema": SCHEMA,
        "recommendation": rec.model_dump(mode="json"),
        "trials": [t.model_dump(mode="json") for t in trials_of(rec, trials)],
        "summary": {
            "label": rec.chosen.candidate.label(),
            "basis": rec.basis,
            "settings": settings_of(rec),
            "state_dict_type": kind,
            "state_dict_reason": why,
        },
    }


__all__ = [
    "SCHEMA",
    "print_summary",
    "report_data",
]
