"""``report.html``: one self-contained page (no scripts, no network) with inline SVG charts of
the memory of every candidate and the throughput of every trial.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from autoshard.config import Candidate, Hardware
from autoshard.errors import AutoshardError
from autoshard.measure import speed_basis, spread_of
from autoshard.results import Decision, MemoryEstimate, Scored, TrialResult, TrialStatus
from autoshard.ui.report import (
    FAILED,
    KIND_COLOURS,
    MEASURED,
    RULED_OUT,
    SKIPPED,
    STATUS_COLOURS,
    error_text,
    listed_rows,
    outcome,
    outcome_counts,
    predicted_device,
    predicted_per_rank,
    rate_per_rank,
    settings_of,
    trial_rate,
    trials_note,
    trials_of,
    why_ruled_out,
)
from autoshard.ui.ticks import byte_ticks, nice_ticks
from autoshard.ui.timeline import timeline_chart
from autoshard.units import format_bytes, format_share

# ---------------------------------------------------------------------------------------------
# HTML with inline SVG charts
# ---------------------------------------------------------------------------------------------


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _memory_rows(
    rec: Decision, trials: Sequence[TrialResult] = ()
) -> list[tuple[str, str, MemoryEstimate | None, int | None]]:
    """(kind, label, estimate, measured peak) of each candidate with either: ``kind`` is
    chosen, runner-up, or its outcome (measured, failed, skipped, ruled out)."""
    rows = []
    for kind, s in listed_rows(rec, trials):
        measured = s.trial.max_allocated if s.trial else None
        if s.estimate is None and measured is None:
            continue
        rows.append((kind, s.candidate.label(), s.estimate, measured))
    return rows


# How the memory chart and the table say what became of a candidate that was not chosen.
NOT_RUN = {SKIPPED: "skipped, never launched", RULED_OUT: "predicted not to fit, never launched"}


class _Axis:
    """A horizontal byte axis, broken when the allowance or the device limit would squeeze
    everything else into a sliver: to scale up to ``cut``, then compressed to ``top``."""

    def __init__(self, x0: float, width: float, content: float, top: float) -> None:
        self.x0, self.top = x0, top
        self.broken = top > 2.5 * content
        self.cut = content * 1.15 if self.broken else top * 1.05
        self.tail = 90.0 if self.broken else 0.0  # pixels for what lies beyond the cut
        self.gap = 14.0 if self.broken else 0.0
        self.scale = (width - self.tail - self.gap) / self.cut

    def x(self, value: float) -> float:
        if value <= self.cut:
            return self.x0 + value * self.scale
        beyond = (value - self.cut) / max(self.top * 1.05 - self.cut, 1.0)
        return self.x0 + self.cut * self.scale + self.gap + min(beyond, 1.0) * self.tail

    @property
    def break_x(self) -> float:
        return self.x0 + self.cut * self.scale + self.gap / 2


def _break_mark(x: float, y: float, h: float) -> str:
    """Two slanted white strokes across a bar or the axis where the scale breaks."""
    return "".join(
        f'<line x1="{x + dx - 4:.1f}" y1="{y + h + 2:.1f}" x2="{x + dx + 4:.1f}" y2="{y - 2:.1f}" '
        'stroke="#fff" stroke-width="3"/>'
        for dx in (-3, 3)
    )


def _memory_note(kind: str, est: MemoryEstimate, measured: int | None) -> str:
    """What the memory chart writes right of a row: the predicted peak and what became of it."""
    note = format_bytes(est.gpu_peak)
    note += "" if est.fits or kind in NOT_RUN else " (does not fit)"
    if kind in NOT_RUN:
        note += f" ({NOT_RUN[kind]})"
    elif kind == FAILED:
        note += " (failed)"
    elif measured is None:
        note += " (not tried)"
    if est.breakdown.allowance:
        note += f", {format_bytes(est.breakdown.allowance)} allowance"
    return note


def memory_chart(rec: Decision, trials: Sequence[TrialResult] = ()) -> str:
    """Predicted memory per candidate stacked by kind, the measured peak, the device limit, and
    a byte axis. The CUDA allowance (hatched) and the limit can dwarf what a CPU-size model
    holds; then the axis breaks after the largest measured or predicted non-allowance bytes,
    and what lies beyond is drawn compressed, so the other kinds stay readable."""
    rows = _memory_rows(rec, trials)
    limit = rec.hardware.gpu_memory
    # To scale: what the candidates that fit (or ran) hold besides the allowance. A pruned
    # candidate's bar may run past the break.
    content = max(
        [1]
        + [e.gpu_peak - e.breakdown.allowance for _, _, e, m in rows if e and (e.fits or m)]
        + [m for _, _, _, m in rows if m is not None]
    )
    top = max([limit, content] + [e.gpu_peak for _, _, e, _ in rows if e])
    label_w, plot_w, bar_h, gap, head = 330, 440, 18, 10, 48
    x0 = label_w
    axis = _Axis(x0, plot_w, content, top)
    bottom = head + len(rows) * (bar_h + gap)
    height = bottom + 110
    # The column of notes right of the plot is as wide as its longest note (about 6 px a char).
    notes_w = max(240, 16 + 6 * max((len(_memory_note(k, e, m)) for k, _, e, m in rows if e),
                                    default=0))  # fmt: skip
    out = [
        f'<svg id="chart-memory" xmlns="http://www.w3.org/2000/svg" '
        f'width="{label_w + plot_w + notes_w}" height="{height}" role="img" '
        'aria-label="memory per candidate">',
        '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#e4dfdc"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#bab0ac" stroke-width="3"/></pattern></defs>',
        f'<text x="{x0}" y="16" class="t">Per-rank GPU memory: predicted (stacked by kind; '
        "faint: never launched) and measured peak (black tick)</text>",
    ]
    out += _byte_grid(axis, x0, head, bottom, top)
    for i, (kind, label, est, measured) in enumerate(rows):
        y = head + i * (bar_h + gap)
        out += _memory_row(kind, label, est, measured, axis, y, bar_h, x0 + plot_w + 8)
    if axis.broken:
        out.append(_break_mark(axis.break_x, bottom - 4, 8))
    out += _limit_lines(rec, axis, head, bottom)
    out += _memory_legend(rows, axis, x0, plot_w, bottom + 30)
    out.append("</svg>")
    return "\n".join(out)


def _byte_grid(axis: _Axis, x0: float, head: float, bottom: float, top: float) -> list[str]:
    """Grid lines and byte ticks of the to-scale part of ``axis``, and the axis line."""
    out = []
    for tick in byte_ticks(axis.cut):
        tx = axis.x(tick)
        out.append(
            f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{head - 6}" y2="{bottom}" stroke="#eee"/>'
            f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#666"/>'
            f'<text x="{tx:.1f}" y="{bottom + 16}" text-anchor="middle" class="s tick">'
            f"{_esc(format_bytes(tick))}</text>"
        )
    out.append(
        f'<line x1="{x0}" x2="{axis.x(top * 1.05):.1f}" y1="{bottom}" y2="{bottom}" stroke="#666"/>'
    )
    return out


def _memory_row(
    kind: str,
    label: str,
    est: MemoryEstimate | None,
    measured: int | None,
    axis: _Axis,
    y: float,
    bar_h: float,
    notes_x: float,
) -> list[str]:
    """One candidate's row of the memory chart: its label, its estimate stacked by kind with
    the note at ``notes_x``, and its measured peak."""
    x0 = axis.x0
    weight = "bold" if kind == "chosen" else "normal"
    # Never launched: the bars are the estimate alone, drawn faint, and the row says so.
    faint = ' fill-opacity="0.35"' if kind in NOT_RUN else ""
    out = [
        f'<text x="{x0 - 8}" y="{y + 13}" text-anchor="end" font-weight="{weight}" '
        f'data-outcome="{_esc(kind)}">{_esc(label)}</text>'
    ]
    end = 0
    if est is not None:
        for term, colour in KIND_COLOURS.items():
            value = getattr(est.breakdown, term)
            if value <= 0:
                continue
            start, end = end, end + value
            xa, xb = axis.x(start), axis.x(end)
            fill = "url(#hatch)" if term == "allowance" else colour
            out.append(
                f'<rect x="{xa:.1f}" y="{y}" width="{max(xb - xa, 0.5):.1f}" height="{bar_h}" '
                f'fill="{fill}"{faint} data-kind="{term}"><title>{_esc(term)}: '
                f"{_esc(format_bytes(value))}</title></rect>"
            )
        if axis.broken and end > axis.cut:
            out.append(_break_mark(axis.break_x, y, bar_h))
        note = _memory_note(kind, est, measured)
        # in a column right of the plot, clear of the limit lines
        out.append(f'<text x="{notes_x}" y="{y + 13}" class="s">{_esc(note)}</text>')
    if measured is not None:
        mx = axis.x(measured)
        out.append(
            f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{y - 3}" y2="{y + bar_h + 3}" '
            f'stroke="#000" stroke-width="3"><title>measured {_esc(format_bytes(measured))}'
            "</title></line>"
        )
    return out


def _limit_lines(rec: Decision, axis: _Axis, head: float, bottom: float) -> list[str]:
    """The device limit and the usable memory, as lines with their values."""
    out = []
    # Two labels side by side: the usable limit's ends at its line, the device's starts at its.
    for value, name, dash, anchor, dx in (
        (rec.hardware.gpu_memory, "device limit", "", "start", 3),
        (rec.hardware.usable_gpu_memory, "usable", ' stroke-dasharray="4 3"', "end", -3),
    ):
        lx = axis.x(value)
        out.append(
            f'<line x1="{lx:.1f}" x2="{lx:.1f}" y1="{head - 8}" y2="{bottom}" stroke="#c62828"'
            f' stroke-width="1.5"{dash}/>'
            f'<text x="{lx + dx:.1f}" y="{head - 12}" text-anchor="{anchor}" class="s" '
            f'fill="#c62828">{name} {_esc(format_bytes(value))}</text>'
        )
    return out


def _memory_legend(
    rows: list[tuple[str, str, MemoryEstimate | None, int | None]],
    axis: _Axis,
    x0: float,
    plot_w: float,
    legend_y: float,
) -> list[str]:
    """Below the memory chart: what a broken axis compresses, and a swatch per kind."""
    out = []
    if axis.broken:
        allowance = any(e is not None and e.breakdown.allowance for _, _, e, _ in rows)
        lines = (
            [
                f"to scale up to {format_bytes(axis.cut)}; compressed beyond the break (//), "
                "where the allowance (hatched: CUDA context, NCCL,",
                "allocator slack, not measured by CPU trials) and the device limit would "
                "squeeze the rest into a sliver",
            ]
            if allowance
            else [
                f"to scale up to {format_bytes(axis.cut)}; compressed beyond the break (//), "
                "where the device limit would squeeze the rest into a sliver"
            ]
        )
        for k, line in enumerate(lines):
            out.append(f'<text x="{x0}" y="{legend_y + 14 * k}" class="s dim">{_esc(line)}</text>')
        legend_y += 14 * len(lines) + 4
    lx = x0
    for term, colour in KIND_COLOURS.items():
        fill = "url(#hatch)" if term == "allowance" else colour
        out.append(
            f'<rect x="{lx}" y="{legend_y}" width="10" height="10" fill="{fill}"/>'
            f'<text x="{lx + 13}" y="{legend_y + 9}" class="s">{term.replace("_", " ")}</text>'
        )
        lx += 13 + 7 * len(term) + 12
        if lx > x0 + plot_w - 60:
            lx = x0
            legend_y += 18
    return out


# (kind, the candidate, predicted per GPU, measured per rank, unit) of each row of the speed chart
_SpeedRow = tuple[str, Scored, float | None, float | None, str]


def speed_chart(rec: Decision, trials: Sequence[TrialResult] = ()) -> str:
    """Predicted against measured throughput of each candidate (per GPU / per rank).

    Trials on the device planned for: both on one axis, the model's error beside. CPU trials
    while planning for GPUs: two panels with their own axes, since the two speak of different
    machines (the GPUs' prediction ranked; the CPU measurement only checked)."""
    rows = _speed_rows(rec, trials)
    ran = [s.trial for _, s, _, _, _ in rows if s.trial is not None]
    shared = speed_basis(rec.hardware, ran) == "trials"
    unit = next((u for *_, u in rows if u), "samples/s")
    device = predicted_device(rec)
    where = next((t.device for t in ran if t.status is TrialStatus.OK), "")
    label_w, panel_w, bar_h, gap, head = 330, 460 if shared else 240, 9, 12, 56
    x0 = label_w
    bottom = head + len(rows) * (2 * bar_h + gap)
    width = label_w + (panel_w if shared else 2 * panel_w + 40) + 150
    out = [
        f'<svg id="chart-speed" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{bottom + 60}" role="img" aria-label="predicted against measured throughput">',
        f'<text x="{x0}" y="16" class="t">Throughput, {_esc(unit)} per GPU (predicted) and per '
        "rank (measured)</text>",
    ]
    if shared:  # (two panels say it in their titles)
        out.append(
            f'<rect x="{x0}" y="25" width="10" height="9" fill="#f28e2b"/>'
            f'<text x="{x0 + 14}" y="33" class="s">predicted for {_esc(device)}</text>'
            f'<rect x="{x0 + 190}" y="25" width="10" height="9" fill="#4e79a7"/>'
            f'<text x="{x0 + 204}" y="33" class="s">measured'
            f"{' on ' + _esc(where) if where else ''}</text>"
        )
    if not rows:
        out.append(f'<text x="{x0}" y="{head}">no predictions or measurements</text></svg>')
        return "\n".join(out)
    for px, top, what in _speed_panels(rows, shared, x0, panel_w):
        scale = panel_w / top if top > 0 else 0.0
        title, colour = {
            "both": ("", ""),
            "predicted": (f"predicted for {device}", "#f28e2b"),
            "measured": (f"measured on {where or 'the trial device'} (own scale)", "#4e79a7"),
        }[what]
        if title:
            out.append(
                f'<rect x="{px}" y="{head - 31}" width="10" height="9" fill="{colour}"/>'
                f'<text x="{px + 14}" y="{head - 23}" class="s" font-weight="bold">'
                f"{_esc(title)}</text>"
            )
        out += _rate_axis(px, top, scale, panel_w, head, bottom)
        for i, (_, s, predicted, measured, _) in enumerate(rows):
            y = head + i * (2 * bar_h + gap)
            bars = []
            if what in ("both", "predicted") and predicted:
                bars.append((y, predicted, "#f28e2b", "predicted"))
            if what in ("both", "measured") and measured:
                bars.append((y + bar_h, measured, "#4e79a7", "measured"))
            out += _speed_bars(rec, s, measured, what, bars, px, top, scale, y, bar_h, unit)
    for i, (kind, s, _, _, _) in enumerate(rows):
        y = head + i * (2 * bar_h + gap)
        weight = "bold" if kind == "chosen" else "normal"
        out.append(
            f'<text x="{x0 - 8}" y="{y + bar_h + 4}" text-anchor="end" font-weight="{weight}">'
            f"{_esc(s.candidate.label())}</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


def _speed_rows(rec: Decision, trials: Sequence[TrialResult]) -> list[_SpeedRow]:
    """The rows of the speed chart: every candidate with a prediction or a measurement, but
    predictions of what cannot run."""
    rows = []
    for kind, s in listed_rows(rec, trials):
        if s.trial is None and (s.estimate is None or not s.estimate.fits):
            continue  # a prediction for what cannot run would only squash the scale
        predicted, p_unit = predicted_per_rank(s, rec.hardware)
        measured, m_unit = rate_per_rank(s.trial)
        if predicted or measured:
            rows.append((kind, s, predicted, measured, p_unit or m_unit))
    return rows


def _speed_panels(
    rows: list[_SpeedRow], shared: bool, x0: float, panel_w: float
) -> list[tuple[float, float, str]]:
    """(x, max, what) of each panel: one for both where they share a device, else one for the
    predictions and one for the measurements, each on its own scale."""
    panels: list[tuple[float, float, str]] = []
    if shared:
        # Scaled to the measured rows; a prediction for a candidate that did not run may
        # reach past the axis, and is clipped with its value written beside.
        measured_rows = [(p or 0, m) for _, _, p, m, _ in rows if m]
        top = max(v for pair in measured_rows for v in pair) if measured_rows else 0.0
        top = top or max(p or 0 for _, _, p, _, _ in rows)
        panels.append((x0, top * 1.1, "both"))
    else:
        panels.append((x0, max(p or 0 for _, _, p, _, _ in rows) * 1.1 or 1.0, "predicted"))
        panels.append(
            (x0 + panel_w + 40, max(m or 0 for _, _, _, m, _ in rows) * 1.1 or 1.0, "measured")
        )
    return panels


def _rate_axis(
    px: float, top: float, scale: float, panel_w: float, head: float, bottom: float
) -> list[str]:
    """A panel's grid lines and rate ticks from 0 to ``top``, and its axis line."""
    out = []
    for tick in nice_ticks(top):
        tx = px + tick * scale
        out.append(
            f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{head - 8}" y2="{bottom}" stroke="#eee"/>'
            f'<text x="{tx:.1f}" y="{bottom + 16}" text-anchor="middle" class="s tick">'
            f"{tick:,.0f}</text>"
        )
    out.append(f'<line x1="{px}" x2="{px + panel_w}" y1="{bottom}" y2="{bottom}" stroke="#666"/>')
    return out


def _speed_bars(
    rec: Decision,
    s: Scored,
    measured: float | None,
    what: str,
    bars: Sequence[tuple[float, float, str, str]],
    px: float,
    top: float,
    scale: float,
    y: float,
    bar_h: float,
    unit: str,
) -> list[str]:
    """One row's ``bars`` (y, value, colour, name) in a panel showing ``what``, clipped at
    ``top``, and the text beside them: the model's error, the clipped value, or the spread of
    the ``measured`` rate."""
    out = []
    clipped = False
    for by, value, colour, name in bars:
        clipped |= value > top
        out.append(
            f'<rect x="{px}" y="{by}" width="{max(min(value, top) * scale, 0.5):.1f}" '
            f'height="{bar_h - 1}" fill="{colour}" data-kind="{name}"><title>{name}: '
            f"{value:,.0f} {_esc(unit)}</title></rect>"
        )
    end = min(max([v for _, v, _, _ in bars] + [0.0]), top)
    text = error_text(s, rec.hardware) if what == "both" else ""
    if clipped:
        text = f"▸ {max(v for _, v, _, _ in bars):,.0f}"
    if what == "measured" and s.trial is not None and measured:
        text = f"±{spread_of(s.trial):.0%}"
    if text:
        out.append(
            f'<text x="{px + end * scale + 4:.1f}" y="{y + bar_h + 4}" class="s">'
            f"{_esc(text)}</text>"
        )
    return out


def throughput_chart(rec: Decision, trials: Sequence[TrialResult]) -> str:
    """Throughput against measured peak memory for every trial; failures on the axis."""
    w, h, left, bottom_pad, top_pad = 760, 360, 80, 50, 30
    chosen_key = rec.chosen.candidate.key()
    points = [(t, t.max_allocated, rate_per_rank(t)[0]) for t in trials]
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
        f'<text x="{left}" y="16" class="t">Throughput ({unit} per rank) against measured '
        "peak memory per rank, every trial that ran</text>",
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
    # Failures ran (oom / error / timeout): on the axis. Skipped and ruled-out candidates never
    # ran: not drawn, only counted.
    failed = [t for t, _, _ in points if t.status.launched and t.status is not TrialStatus.OK]
    counts = outcome_counts(rec, trials)
    for t, m, r in ok:
        chosen = t.candidate.key() == chosen_key
        out.append(
            f'<circle cx="{sx(m):.1f}" cy="{sy(r):.1f}" r="{8 if chosen else 5}" '
            f'fill="{"#2e7d32" if chosen else "#4e79a7"}" stroke="#000" '
            f'stroke-width="{2 if chosen else 0.5}" data-outcome="measured"><title>'
            f"{_esc(t.candidate.label())}: {r:,.0f} {unit} per rank, {_esc(format_bytes(m))}"
            "</title></circle>"
        )
        if chosen:
            out.append(
                f'<text x="{sx(m) + 11:.1f}" y="{sy(r) + 4:.1f}" class="s" font-weight="bold">'
                "chosen</text>"
            )
    out += _failure_marks(failed, left, top_pad + ph - 8)
    never = [f"{counts[SKIPPED]} skipped"] if counts[SKIPPED] else []
    never += [f"{counts[RULED_OUT]} predicted not to fit"] if counts[RULED_OUT] else []
    if never:
        out.append(
            f'<text x="{left + pw - 8}" y="{top_pad + ph - 8}" text-anchor="end" class="s dim" '
            f'data-outcome="never launched">{_esc(" and ".join(never))}: never launched, '
            "not drawn</text>"
        )
    if not ok:
        out.append(
            f'<text x="{left + pw / 2}" y="{top_pad + ph / 2}" text-anchor="middle">'
            "no measured trials (chosen by estimate)</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


def _failure_marks(failed: list[TrialResult], left: float, y: float) -> list[str]:
    """A cross per failed trial along the throughput chart's axis, and how many failed."""
    out = []
    for i, t in enumerate(failed):
        x = left + 10 + i * 14
        out.append(
            f'<text x="{x}" y="{y}" fill="{STATUS_COLOURS[t.status]}" font-weight="bold" '
            f'data-outcome="failed">×<title>{_esc(t.candidate.label())}: '
            f"{_esc(t.status.value)}</title></text>"
        )
    if failed:
        out.append(
            f'<text x="{left + 12 + len(failed) * 14}" y="{y}" class="s" '
            f'data-outcome="failed">{len(failed)} failed (oom / error / timeout)</text>'
        )
    return out


def _table(rec: Decision, trials: Sequence[TrialResult] = ()) -> str:
    device = predicted_device(rec)
    listed = listed_rows(rec, trials)
    errors = [error_text(s, rec.hardware) or None for _, s in listed]
    # The model's error exists only where trials ran on the device predicted for.
    with_error = any(e is not None for e in errors)
    head = ["", "configuration", "predicted peak / rank", "measured peak / rank",
            f"predicted throughput / GPU ({device})", "measured throughput / rank",
            *(["model error"] if with_error else []), "s/step", "outcome"]  # fmt: skip
    rows = ["<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>"]
    for (kind, s), error in zip(listed, errors, strict=True):
        t, e = s.trial, s.estimate
        predicted, p_unit = predicted_per_rank(s, rec.hardware)
        measured, m_unit = rate_per_rank(t)
        result = outcome(s)
        if result == MEASURED or (kind in ("chosen", "runner-up") and result is None):
            status = MEASURED if result else "fits, not tried"
        else:
            status = why_ruled_out(s)
        cells = [
            kind,
            s.candidate.label(),
            format_bytes(e.gpu_peak) if e else "",
            format_bytes(t.max_allocated) if t and t.max_allocated else "",
            f"{predicted:,.0f} {p_unit}" if predicted else "",
            f"{measured:,.0f} {m_unit} ±{spread_of(t):.0%}" if measured and t else "",
            *([(error or "").removeprefix("model ")] if with_error else []),
            f"{t.step_time:.3f}" if t and t.step_time else "",
            status,
        ]
        cls = ' class="chosen"' if kind == "chosen" else ""
        rows.append(
            f'<tr{cls} data-outcome="{_esc(result or "not tried")}">'
            + "".join(f"<td>{_esc(c)}</td>" for c in cells)
            + "</tr>"
        )
    return '<table id="configurations">' + "\n".join(rows) + "</table>"


_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;
 max-width:1000px}
h1{font-size:22px} h2{font-size:17px;margin-top:28px}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:4px 8px;
 text-align:left} tr.chosen td{background:#e8f5e9;font-weight:600}
svg{font-size:12px;font-family:inherit;display:block;margin:8px 0} svg .t{font-weight:600}
svg .s{font-size:11px} svg .dim{fill:#666} ul{margin:4px 0}
 p.note{background:#fff8e1;border-left:4px solid #f9a825;padding:6px 10px}
 pre{background:#f6f8fa;padding:10px;font-size:12px;overflow:auto} .dim{color:#666}
"""


def _timeline_section(rec: Decision) -> str:
    """The chosen configuration's memory over its step, where the decision carries it."""
    chart = timeline_chart(rec)
    if not chart:
        return ""
    seconds = "calibrated" if rec.timeline and rec.timeline.calibrated else "uncalibrated"
    return (
        "<h2>Memory over the chosen configuration's step</h2>\n"
        f'<p class="dim">Memory events of the analytic estimate on the {seconds} speed '
        "model's seconds (<code>autoshard estimate --timeline</code> lists them)</p>\n" + chart
    )


def render_html(rec: Decision, trials: Sequence[TrialResult] = ()) -> str:
    """One self-contained HTML page: no scripts, no network, charts as inline SVG."""
    from autoshard.emit.runtime import choose_state_dict_type
    from autoshard.emit.text import lightning_cli_yaml

    all_trials = trials_of(rec, trials)
    note = trials_note(rec, all_trials)
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
{memory_chart(rec, all_trials)}
{_timeline_section(rec)}
<h2>Predicted and measured throughput</h2>
{f'<p class="note">{_esc(note)}</p>' if note else ""}
{speed_chart(rec, all_trials)}
<h2>Throughput and memory of every trial</h2>
{throughput_chart(rec, all_trials)}
<h2>All configurations</h2>
{_table(rec, all_trials)}
<h2>Lightning CLI</h2><pre>{_esc(yaml_text)}</pre>
</body></html>
"""


def recommendation_html(rec: Decision) -> str:
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


def estimates_html(
    estimates: Sequence[MemoryEstimate],
    hardware: Hardware | None,
    chosen: Candidate | None = None,
    limit: int | None = 20,
) -> str:
    """A notebook cell's view of a list of estimates: one row per candidate (the first
    ``limit``), the recommended one (``chosen``) marked."""
    head = ("configuration", "fits", "GPU peak", "headroom", "host / node", "tokens/s per GPU",
            "MFU")  # fmt: skip
    rows = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    shown = list(estimates) if limit is None else list(estimates)[:limit]
    for e in shown:
        s = e.speed
        mark = chosen is not None and e.candidate == chosen
        cells = (
            e.candidate.label() + (" ← recommended" if mark else ""),
            "yes" if e.fits else "no",
            format_bytes(e.gpu_peak),
            format_bytes(e.headroom),
            format_bytes(e.host_peak) if e.host_peak else "",
            f"{s.tokens_per_s_per_gpu:,.0f}" if s and s.tokens_per_s_per_gpu else "",
            format_share(s.mfu) if s and s.mfu is not None else "",
        )
        style = ' class="recommended" style="font-weight:bold;background:#e8f5e9"' if mark else ""
        rows.append(f"<tr{style}>" + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>")
    title = ""
    if hardware is not None:
        title = (
            f"<p>{hardware.nodes} x {hardware.gpus_per_node} GPUs of "
            f"{_esc(format_bytes(hardware.gpu_memory))}; fitting candidates first</p>"
        )
    more = len(estimates) - len(shown)
    tail = f"<p>{more} more not shown (list(estimates) has them all)</p>" if more > 0 else ""
    return f"<div>{title}<table>{''.join(rows)}</table>{tail}</div>"
