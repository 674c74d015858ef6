"""Reports of a :class:`~autoshard.models.Recommendation`: a rich terminal summary, ``report.json``
(stable for scripts), ``report.html`` (one self-contained file with inline SVG charts), and the
emitted YAML next to them. :func:`load_result` reads any of these back for ``autoshard export``.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from autoshard._units import format_bytes
from autoshard.errors import AutoshardError, ResultError
from autoshard.models import (
    MemoryEstimate,
    Recommendation,
    Scored,
    TrialResult,
    TrialStatus,
)

SCHEMA = "autoshard.report/1"

# One colour per MemoryBreakdown term, in stacking order.
_KINDS: dict[str, str] = {
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
_STATUS_COLOUR = {
    TrialStatus.OK: "#2e7d32",
    TrialStatus.OOM: "#e65100",
    TrialStatus.ERROR: "#c62828",
    TrialStatus.TIMEOUT: "#c62828",
    TrialStatus.PRUNED: "#757575",
}


def _scored(rec: Recommendation) -> list[tuple[str, Scored]]:
    return [
        ("chosen", rec.chosen),
        *(("runner-up", s) for s in rec.runners_up),
        *(("ruled out", s) for s in rec.ruled_out),
    ]


def _trials(rec: Recommendation, trials: Iterable[TrialResult]) -> list[TrialResult]:
    """The trials given, or those the recommendation carries."""
    given = list(trials)
    if given:
        return given
    return [s.trial for _, s in _scored(rec) if s.trial is not None]


def _rate(t: TrialResult | None) -> tuple[float | None, str]:
    if t is None:
        return None, ""
    if t.tokens_per_s:
        return t.tokens_per_s, "tokens/s"
    return t.samples_per_s, "samples/s"


def _why_out(s: Scored) -> str:
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
    from autoshard.emit import choose_state_dict_type

    console = console or Console()
    c = rec.chosen.candidate
    console.print(f"[bold green]Recommended[/] ({rec.basis}): [bold]{c.label()}[/]")
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column()
    for key, value in _settings(rec).items():
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
            rate, unit = _rate(s.trial)
            ok = s.trial is not None and s.trial.status is TrialStatus.OK
            note = f"{rate:,.0f} {unit}" if ok and rate else _why_out(s)
            alt.add_row(
                kind,
                s.candidate.label(),
                format_bytes(s.estimate.gpu_peak) if s.estimate else "",
                format_bytes(s.trial.max_allocated) if s.trial and s.trial.max_allocated else "",
                note[:80],
            )
        console.print(alt)
    n = sum(1 for t in _trials(rec, trials) if t.status is not TrialStatus.PRUNED)
    if n:
        console.print(f"[dim]{n} trials ran; see report.html for charts[/]")


def _settings(rec: Recommendation) -> dict[str, str]:
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
        rate, unit = _rate(t)
        out["measured"] = f"{t.step_time:.3f} s/step" + (f", {rate:,.0f} {unit}" if rate else "")
        if t.max_allocated:
            out["measured"] += f", peak {format_bytes(t.max_allocated)} on {t.device}"
    return out


# ---------------------------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------------------------


def report_data(rec: Recommendation, trials: Sequence[TrialResult] = ()) -> dict[str, Any]:
    """Everything, for scripts. Keys are only ever added under one schema version."""
    from autoshard.emit import choose_state_dict_type

    kind, why = choose_state_dict_type(rec)
    return {
        "schema": SCHEMA,
        "recommendation": rec.model_dump(mode="json"),
        "trials": [t.model_dump(mode="json") for t in _trials(rec, trials)],
        "summary": {
            "label": rec.chosen.candidate.label(),
            "basis": rec.basis,
            "settings": _settings(rec),
            "state_dict_type": kind,
            "state_dict_reason": why,
        },
    }


# ---------------------------------------------------------------------------------------------
# HTML with inline SVG charts
# ---------------------------------------------------------------------------------------------


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _memory_rows(rec: Recommendation) -> list[tuple[str, str, MemoryEstimate | None, int | None]]:
    rows = []
    for kind, s in _scored(rec):
        measured = s.trial.max_allocated if s.trial else None
        if s.estimate is None and measured is None:
            continue
        rows.append((kind, s.candidate.label(), s.estimate, measured))
    return rows


def memory_chart(rec: Recommendation) -> str:
    """Predicted memory per candidate stacked by kind, the measured peak, and the device limit."""
    rows = _memory_rows(rec)
    limit = rec.hardware.gpu_memory
    top = max(
        [limit]
        + [e.gpu_peak for _, _, e, _ in rows if e]
        + [m for _, _, _, m in rows if m is not None]
    )
    label_w, plot_w, bar_h, gap, head = 330, 560, 18, 10, 48
    height = head + len(rows) * (bar_h + gap) + 70
    scale = plot_w / (top * 1.05)
    x0 = label_w
    out = [
        f'<svg id="chart-memory" xmlns="http://www.w3.org/2000/svg" '
        f'width="{label_w + plot_w + 170}" height="{height}" role="img" '
        'aria-label="memory per candidate">',
        f'<text x="{x0}" y="16" class="t">Per-rank GPU memory: predicted (stacked by kind) '
        "and measured peak (black tick)</text>",
    ]
    for i, (kind, label, est, measured) in enumerate(rows):
        y = head + i * (bar_h + gap)
        weight = "bold" if kind == "chosen" else "normal"
        out.append(
            f'<text x="{x0 - 8}" y="{y + 13}" text-anchor="end" font-weight="{weight}">'
            f"{_esc(label)}</text>"
        )
        x = float(x0)
        if est is not None:
            for term, colour in _KINDS.items():
                value = getattr(est.breakdown, term)
                if value <= 0:
                    continue
                w = value * scale
                out.append(
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="{colour}">'
                    f"<title>{_esc(term)}: {_esc(format_bytes(value))}</title></rect>"
                )
                x += w
            out.append(
                f'<text x="{x + 4:.1f}" y="{y + 13}" class="s">'
                f"{_esc(format_bytes(est.gpu_peak))}{'' if est.fits else ' (does not fit)'}</text>"
            )
        if measured is not None:
            mx = x0 + measured * scale
            out.append(
                f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{y - 3}" y2="{y + bar_h + 3}" '
                f'stroke="#000" stroke-width="3"><title>measured {_esc(format_bytes(measured))}'
                "</title></line>"
            )
    bottom = head + len(rows) * (bar_h + gap)
    # Two labels side by side: the usable limit's ends at its line, the device's starts at its.
    for value, name, dash, anchor, dx in (
        (limit, "device limit", "", "start", 3),
        (rec.hardware.usable_gpu_memory, "usable", ' stroke-dasharray="4 3"', "end", -3),
    ):
        lx = x0 + value * scale
        out.append(
            f'<line x1="{lx:.1f}" x2="{lx:.1f}" y1="{head - 8}" y2="{bottom}" stroke="#c62828"'
            f' stroke-width="1.5"{dash}/>'
            f'<text x="{lx + dx:.1f}" y="{head - 12}" text-anchor="{anchor}" class="s" '
            f'fill="#c62828">{name} {_esc(format_bytes(value))}</text>'
        )
    lx = x0
    for term, colour in _KINDS.items():
        out.append(
            f'<rect x="{lx}" y="{bottom + 20}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{lx + 13}" y="{bottom + 29}" class="s">{term.replace("_", " ")}</text>'
        )
        lx += 13 + 7 * len(term) + 12
        if lx > x0 + plot_w - 60:
            lx = x0
            bottom += 18
    out.append("</svg>")
    return "\n".join(out)


def throughput_chart(rec: Recommendation, trials: Sequence[TrialResult]) -> str:
    """Throughput against measured peak memory for every trial; failures on the axis."""
    w, h, left, bottom_pad, top_pad = 760, 360, 80, 50, 30
    chosen_key = rec.chosen.candidate.key()
    points = [(t, t.max_allocated, _rate(t)[0]) for t in trials]
    ok = [(t, m, r) for t, m, r in points if t.status is TrialStatus.OK and m and r]
    unit = next((_rate(t)[1] for t, _, _ in ok), "samples/s")
    max_mem = max([m for _, m, _ in ok] + [1]) * 1.15
    max_rate = max([r for _, _, r in ok] + [1.0]) * 1.15
    pw, ph = w - left - 60, h - top_pad - bottom_pad

    def sx(m: float) -> float:
        return left + m / max_mem * pw

    def sy(r: float) -> float:
        return top_pad + ph - r / max_rate * ph

    out = [
        f'<svg id="chart-throughput" xmlns="http://www.w3.org/2000/svg" width="{w}" '
        f'height="{h}" role="img" aria-label="throughput against peak memory">',
        f'<text x="{left}" y="16" class="t">Throughput ({unit}) against measured peak memory '
        "per rank, every trial</text>",
        f'<rect x="{left}" y="{top_pad}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
    ]
    for k in range(5):
        m, r = max_mem * k / 4, max_rate * k / 4
        out.append(
            f'<text x="{sx(m):.1f}" y="{h - bottom_pad + 16}" text-anchor="middle" class="s">'
            f"{_esc(format_bytes(m))}</text>"
            f'<text x="{left - 6}" y="{sy(r) + 4:.1f}" text-anchor="end" class="s">{r:,.0f}</text>'
        )
    out.append(
        f'<text x="{left + pw / 2}" y="{h - 8}" text-anchor="middle" class="s">measured peak '
        "allocated per rank</text>"
    )
    failed = [t for t, _, _ in points if t.status is not TrialStatus.OK]
    for t, m, r in ok:
        chosen = t.candidate.key() == chosen_key
        out.append(
            f'<circle cx="{sx(m):.1f}" cy="{sy(r):.1f}" r="{8 if chosen else 5}" '
            f'fill="{"#2e7d32" if chosen else "#4e79a7"}" stroke="#000" '
            f'stroke-width="{2 if chosen else 0.5}"><title>{_esc(t.candidate.label())}: '
            f"{r:,.0f} {unit}, {_esc(format_bytes(m))}</title></circle>"
        )
        if chosen:
            out.append(
                f'<text x="{sx(m) + 11:.1f}" y="{sy(r) + 4:.1f}" class="s" font-weight="bold">'
                "chosen</text>"
            )
    for i, t in enumerate(failed):
        x = left + 10 + i * 14
        y = top_pad + ph - 8
        out.append(
            f'<text x="{x}" y="{y}" fill="{_STATUS_COLOUR[t.status]}" font-weight="bold">×'
            f"<title>{_esc(t.candidate.label())}: {_esc(t.status.value)}</title></text>"
        )
    if failed:
        out.append(
            f'<text x="{left + 12 + len(failed) * 14}" y="{top_pad + ph - 8}" class="s">'
            f"{len(failed)} failed (oom / error / timeout)</text>"
        )
    if not ok:
        out.append(
            f'<text x="{left + pw / 2}" y="{top_pad + ph / 2}" text-anchor="middle">'
            "no measured trials (chosen by estimate)</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


def _table(rec: Recommendation) -> str:
    head = ("", "configuration", "predicted / rank", "measured peak", "s/step", "throughput",
            "status")  # fmt: skip
    rows = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for kind, s in _scored(rec):
        t, e = s.trial, s.estimate
        rate, unit = _rate(t)
        status = t.status.value if t else ("fits" if e and e.fits else "pruned")
        if kind == "ruled out":
            status = _why_out(s) if t else f"{status} — {_why_out(s)}"
        cells = (
            kind,
            s.candidate.label(),
            format_bytes(e.gpu_peak) if e else "",
            format_bytes(t.max_allocated) if t and t.max_allocated else "",
            f"{t.step_time:.3f}" if t and t.step_time else "",
            f"{rate:,.0f} {unit}" if rate else "",
            status,
        )
        cls = ' class="chosen"' if kind == "chosen" else ""
        rows.append(f"<tr{cls}>" + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>")
    return '<table id="configurations">' + "\n".join(rows) + "</table>"


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;
 max-width:1000px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:4px 8px;
 text-align:left} tr.chosen td{background:#e8f5e9;font-weight:600}
svg{font-size:12px;font-family:inherit;display:block;margin:8px 0} svg .t{font-weight:600}
svg .s{font-size:11px} ul{margin:4px 0} pre{background:#f6f8fa;padding:10px;font-size:12px;
 overflow:auto} .dim{color:#666}
"""


def render_html(rec: Recommendation, trials: Sequence[TrialResult] = ()) -> str:
    """One self-contained HTML page: no scripts, no network, charts as inline SVG."""
    from autoshard.emit import choose_state_dict_type, lightning_cli_yaml

    all_trials = _trials(rec, trials)
    settings = "".join(
        f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in _settings(rec).items()
    )
    reasons = "".join(f"<li>{_esc(r)}</li>" for r in (*rec.reasons, choose_state_dict_type(rec)[1]))
    try:
        yaml_text = lightning_cli_yaml(rec)
    except AutoshardError as exc:
        yaml_text = f"# {exc}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autoshard: {_esc(rec.profile.target)}</title>
<style>{_CSS}</style></head><body>
<h1>autoshard recommendation: {_esc(rec.chosen.candidate.label())}</h1>
<p class="dim">{_esc(rec.profile.target)} · {rec.profile.total_params:,} parameters ·
{rec.hardware.nodes} x {rec.hardware.gpus_per_node} GPUs of
{_esc(format_bytes(rec.hardware.gpu_memory))} · chosen by {_esc(rec.basis)} ·
{_esc(rec.created_at.strftime("%Y-%m-%d %H:%M UTC"))}</p>
<h2>Chosen configuration</h2><table id="chosen">{settings}</table>
<h2>Why it won</h2><ul>{reasons}</ul>
<h2>Memory per candidate</h2>
{memory_chart(rec)}
<h2>Throughput and memory of every trial</h2>
{throughput_chart(rec, all_trials)}
<h2>All configurations</h2>
{_table(rec)}
<h2>Lightning CLI</h2><pre>{_esc(yaml_text)}</pre>
</body></html>
"""


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def write_report(
    rec: Recommendation, out_dir: Path | str, trials: Sequence[TrialResult] = ()
) -> dict[str, Path]:
    """Write report.json, report.html, lightning.yaml and accelerate.yaml into ``out_dir``.

    A YAML that cannot express the choice (see emit) is left out; the rest is still written.
    """
    from autoshard.emit import accelerate_yaml, lightning_cli_yaml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    texts = {
        "report.json": lambda: json.dumps(report_data(rec, trials), indent=2) + "\n",
        "report.html": lambda: render_html(rec, trials),
        "lightning.yaml": lambda: lightning_cli_yaml(rec),
        "accelerate.yaml": lambda: accelerate_yaml(rec),
    }
    for name, make in texts.items():
        try:
            text = make()
        except AutoshardError:
            continue
        path = out / name
        path.write_text(text, encoding="utf-8")
        written[name] = path
    return written


def load_result(path: Path | str) -> tuple[Recommendation, list[TrialResult]]:
    """Read what ``tune`` or ``estimate`` wrote: an output folder (report.json, or
    recommendation.json + trials.jsonl) or one of those JSON files."""
    p = Path(path)
    if p.is_dir():
        for name in ("report.json", "recommendation.json"):
            if (p / name).is_file():
                return load_result(p / name)
        raise ResultError(f"{p}: no report.json or recommendation.json here; run `autoshard tune`")
    if not p.is_file():
        raise ResultError(f"{p}: no such file or folder")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultError(f"{p}: not a JSON result ({exc})") from None
    try:
        return _from_json(data, p)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ResultError(f"{p}: not an autoshard result ({where}: {first['msg']})") from None


def _from_json(data: Any, p: Path) -> tuple[Recommendation, list[TrialResult]]:
    if not isinstance(data, dict):
        raise ResultError(f"{p}: not an autoshard result (a JSON object is expected)")
    if data.get("schema", "").startswith("autoshard.report/"):
        rec = Recommendation.model_validate(data["recommendation"])
        return rec, [TrialResult.model_validate(t) for t in data.get("trials", [])]
    if "chosen" in data and "profile" in data:
        rec = Recommendation.model_validate(data)
        return rec, _read_trials(p.with_name("trials.jsonl"))
    if "estimates" in data:
        return _from_estimates(data, p), []
    raise ResultError(f"{p}: not an autoshard result (from `tune` or `estimate --json`)")


def _read_trials(path: Path) -> list[TrialResult]:
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(TrialResult.model_validate_json(line))
            except ValidationError:
                raise ResultError(f"{path}:{n}: not a trial record") from None
    return out


def _from_estimates(data: dict[str, Any], p: Path) -> Recommendation:
    """``estimate --json``: the fastest-expected candidate that fits (the list is ranked)."""
    from autoshard.models import Hardware, ModelProfile, WorkloadSpec

    if "profile" not in data:
        raise ResultError(
            f"{p}: this estimate JSON has no model profile; re-run `autoshard estimate --json` "
            "with this version, or export from a `tune` output folder"
        )
    estimates = [MemoryEstimate.model_validate(e) for e in data["estimates"]]
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        raise ResultError(f"{p}: no candidate fits in this estimate; nothing to export")
    best = fitting[0]
    return Recommendation(
        profile=ModelProfile.model_validate(data["profile"]),
        hardware=Hardware.model_validate(data["hardware"]),
        workload=WorkloadSpec.model_validate(data["workload"]),
        chosen=Scored(candidate=best.candidate, estimate=best),
        runners_up=tuple(Scored(candidate=e.candidate, estimate=e) for e in fitting[1:4]),
        ruled_out=tuple(Scored(candidate=e.candidate, estimate=e) for e in estimates if not e.fits),
        basis="estimate",
        reasons=(
            f"fastest expected of {len(fitting)} candidates predicted to fit "
            f"({format_bytes(best.gpu_peak)} per rank)",
        ),
    )


__all__ = [
    "SCHEMA",
    "load_result",
    "print_summary",
    "render_html",
    "report_data",
    "write_report",
]
