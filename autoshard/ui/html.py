"""``report.html``: one self-contained page (no scripts, no network) with inline SVG charts of
the memory of every candidate and the throughput of every trial.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from autoshard.config import Hardware
from autoshard.errors import AutoshardError
from autoshard.results import MemoryEstimate, Recommendation, TrialResult, TrialStatus
from autoshard.ui.report import (
    KIND_COLOURS,
    STATUS_COLOURS,
    scored_rows,
    settings_of,
    trial_rate,
    trials_of,
    why_ruled_out,
)
from autoshard.units import format_bytes

# ---------------------------------------------------------------------------------------------
# HTML with inline SVG charts
# ---------------------------------------------------------------------------------------------


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _memory_rows(rec: Recommendation) -> list[tuple[str, str, MemoryEstimate | None, int | None]]:
    rows = []
    for kind, s in scored_rows(rec):
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
            for term, colour in KIND_COLOURS.items():
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
    for term, colour in KIND_COLOURS.items():
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
    points = [(t, t.max_allocated, trial_rate(t)[0]) for t in trials]
    ok = [(t, m, r) for t, m, r in points if t.status is TrialStatus.OK and m and r]
    unit = next((trial_rate(t)[1] for t, _, _ in ok), "samples/s")
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
            f'<text x="{x}" y="{y}" fill="{STATUS_COLOURS[t.status]}" font-weight="bold">×'
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
    for kind, s in scored_rows(rec):
        t, e = s.trial, s.estimate
        rate, unit = trial_rate(t)
        status = t.status.value if t else ("fits" if e and e.fits else "pruned")
        if kind == "ruled out":
            status = why_ruled_out(s) if t else f"{status} — {why_ruled_out(s)}"
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
    from autoshard.emit.runtime import choose_state_dict_type
    from autoshard.emit.text import lightning_cli_yaml

    all_trials = trials_of(rec, trials)
    settings = "".join(
        f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in settings_of(rec).items()
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


def recommendation_html(rec: Recommendation) -> str:
    """A notebook cell's view of a recommendation: the choice, its settings, why."""
    settings = "".join(
        f"<tr><th style='text-align:left'>{_esc(k)}</th><td style='text-align:left'>{_esc(v)}"
        "</td></tr>"
        for k, v in settings_of(rec).items()
    )
    reasons = "".join(f"<li>{_esc(r)}</li>" for r in rec.reasons[:12])
    return (
        f"<div><b>autoshard recommends {_esc(rec.chosen.candidate.label())}</b> "
        f"<span>(by {_esc(rec.basis)})</span><table>{settings}</table>"
        f"<details><summary>why</summary><ul>{reasons}</ul></details></div>"
    )


def estimates_html(estimates: Sequence[MemoryEstimate], hardware: Hardware | None) -> str:
    """A notebook cell's view of a list of estimates: one row per candidate."""
    head = ("configuration", "fits", "GPU peak", "headroom", "tokens/s/GPU", "MFU")
    rows = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for e in estimates:
        s = e.speed
        cells = (
            e.candidate.label(),
            "yes" if e.fits else "no",
            format_bytes(e.gpu_peak),
            format_bytes(e.headroom),
            f"{s.tokens_per_s_per_gpu:,.0f}" if s and s.tokens_per_s_per_gpu else "",
            f"{s.mfu:.0%}" if s and s.mfu is not None else "",
        )
        rows.append("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>")
    title = ""
    if hardware is not None:
        title = (
            f"<p>{hardware.nodes} x {hardware.gpus_per_node} GPUs of "
            f"{_esc(format_bytes(hardware.gpu_memory))}; fitting candidates first</p>"
        )
    return f"<div>{title}<table>{''.join(rows)}</table></div>"
