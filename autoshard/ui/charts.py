"""report.html's charts as inline SVG (no script, no network): memory per candidate, predicted
against measured throughput, throughput against peak memory of every trial.

Each draws a :class:`Page`: the hardware, every candidate with what it is to the decision, the
trials; a finished study's page (:func:`page_of`) or a failed one's (no candidate chosen).
Every outcome (:data:`autoshard.results.OUTCOMES`) has its own mark in every chart and its own
legend entry; labels are measured (:func:`autoshard.ui.textwidth.text_width`), never clipped.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.config import Hardware
from autoshard.measure import speed_basis, spread_of
from autoshard.results import Decision, MemoryEstimate, Scored, TrialResult, TrialStatus
from autoshard.ui.report import (
    FAILED,
    KIND_COLOURS,
    MEASURED,
    OUTCOME_BY_WORD,
    RULED_OUT,
    SKIPPED,
    error_text,
    listed_rows,
    never_launched,
    outcome,
    predicted_device_of,
    predicted_per_rank,
    prediction_error,
    rate_per_rank,
    trial_rate,
    trials_of,
)
from autoshard.ui.textwidth import text_width
from autoshard.ui.ticks import byte_ticks, nice_ticks
from autoshard.units import format_bytes

FONT = 12.0  # svg text, px (the page's CSS)
SMALL = 11.0  # svg .s
PREDICTED, MEASURED_BAR = "#f28e2b", "#4e79a7"
MARK_W = 16.0  # the outcome mark's column, between a row's label and its bars


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


@dataclass(frozen=True)
class Page:
    """What the charts and the table draw: the ``hardware`` planned for, every candidate as
    (what it is to the decision: chosen, runner-up or its outcome, the candidate), the
    ``trials`` that ran or were recorded, and the chosen one's label (None: a study in which
    nothing ran)."""

    hardware: Hardware
    rows: list[tuple[str, Scored]]
    trials: list[TrialResult]
    chosen: str | None

    @property
    def device(self) -> str:
        """What the predictions are for."""
        return predicted_device_of([s for _, s in self.rows], self.hardware)


def page_of(rec: Decision, trials: Sequence[TrialResult] = ()) -> Page:
    """A finished study's page (or an estimate's)."""
    return Page(
        rec.hardware, listed_rows(rec, trials), trials_of(rec, trials),
        rec.chosen.candidate.label(),
    )  # fmt: skip


def label_column(labels: Sequence[str]) -> float:
    """The width left of a chart's plot for its row labels (the chosen one's in bold) and the
    outcome marks: the widest label, measured, and a margin."""
    widest = max((text_width(label, FONT, bold=True) for label in labels), default=0.0)
    return 12 + widest + 6 + MARK_W


def _word(kind: str, s: Scored) -> str | None:
    return (
        outcome(s) if kind in ("chosen", "runner-up") else kind if kind in OUTCOME_BY_WORD else None
    )


def outcome_mark(
    word: str | None, x: float, y: float, title: str | None = None, attrs: str = ""
) -> str:
    """The outcome's mark centred at (x, y): a solid dot (measured), a diamond (diverged), a cross
    (failed), a hollow dot (skipped), a hatched square (ruled out); none for a candidate never
    tried (an estimate's runner-up). ``title``: its tooltip (the outcome's word by default)."""
    if word is None:
        return ""
    o = OUTCOME_BY_WORD[word]
    title = f"<title>{_esc(title or word)}</title>"
    attrs = f'data-mark="{_esc(word)}" {attrs}'.strip()
    if o.mark == "solid":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{o.colour}" {attrs}>{title}</circle>'
    if o.mark == "outline":
        return (
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="#fff" stroke="{o.colour}" '
            f'stroke-width="1.5" {attrs}>{title}</circle>'
        )
    if o.mark == "diamond":
        return (
            f'<path d="M{x:.1f},{y - 5:.1f}L{x + 5:.1f},{y:.1f}L{x:.1f},{y + 5:.1f}L{x - 5:.1f},'
            f'{y:.1f}Z" fill="{o.colour}" {attrs}>{title}</path>'
        )
    if o.mark == "hatched":
        return (
            f'<rect x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="url(#ruled)" '
            f'stroke="{o.colour}" {attrs}>{title}</rect>'
        )
    return (
        f'<path d="M{x - 4:.1f},{y - 4:.1f}L{x + 4:.1f},{y + 4:.1f}M{x - 4:.1f},{y + 4:.1f}'
        f'L{x + 4:.1f},{y - 4:.1f}" stroke="{o.colour}" stroke-width="2.2" {attrs}>{title}</path>'
    )


PATTERNS = (
    '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(45)"><rect width="6" height="6" fill="#e4dfdc"/>'
    '<line x1="0" y1="0" x2="0" y2="6" stroke="#bab0ac" stroke-width="3"/></pattern>'
    '<pattern id="ruled" width="4" height="4" patternUnits="userSpaceOnUse" '
    'patternTransform="rotate(-45)"><rect width="4" height="4" fill="#fff"/>'
    '<line x1="0" y1="0" x2="0" y2="4" stroke="#757575" stroke-width="1.5"/></pattern></defs>'
)


def outcome_legend(
    words: Sequence[str], x: float, y: float, width: float
) -> tuple[list[str], float]:
    """A legend entry per outcome in ``words`` (each its mark and word) from (x, y), wrapped
    at ``width``; and the y below it."""
    out, lx = [], x
    for word in dict.fromkeys(words):
        says = OUTCOME_BY_WORD[word].says
        entry = 16 + text_width(says, SMALL) + 16
        if lx > x and lx + entry > x + width:
            lx, y = x, y + 18
        out.append(outcome_mark(word, lx + 5, y + 5))
        out.append(
            f'<text x="{lx + 14:.1f}" y="{y + 9:.1f}" class="s" data-legend="{_esc(word)}">'
            f"{_esc(says)}</text>"
        )
        lx += entry
    return out, y + 18


def _row_label(label: str, kind: str, s: Scored, right: float, y: float) -> list[str]:
    """A row's label, right-aligned at ``right`` (the chosen one bold), and its outcome mark."""
    weight = "bold" if kind == "chosen" else "normal"
    return [
        f'<text x="{right - MARK_W:.1f}" y="{y:.1f}" text-anchor="end" font-weight="{weight}" '
        f'class="label" data-outcome="{_esc(kind)}">{_esc(label)}</text>',
        outcome_mark(_word(kind, s), right - MARK_W / 2, y - 4),
    ]


# ---------------------------------------------------------------------------------------------
# Memory per candidate
# ---------------------------------------------------------------------------------------------


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
    def end(self) -> float:
        return self.x(self.top * 1.05)

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


# (kind, the candidate, its estimate, its measured peak) of each row of the memory chart
_MemoryRow = tuple[str, Scored, MemoryEstimate | None, int | None]


def _memory_rows(page: Page) -> list[_MemoryRow]:
    rows = []
    for kind, s in page.rows:
        measured = s.trial.max_allocated if s.trial else None
        if s.estimate is not None or measured is not None:
            rows.append((kind, s, s.estimate, measured))
    return rows


def _memory_note(kind: str, s: Scored, est: MemoryEstimate) -> str:
    """What the memory chart writes right of a row: the predicted peak and what became of it."""
    note = format_bytes(est.gpu_peak)
    word = _word(kind, s)
    if word in (SKIPPED, RULED_OUT):
        note += f" ({OUTCOME_BY_WORD[word].says})"
    elif word == FAILED:
        note += f" (failed: {s.trial.status.value})" if s.trial else " (failed)"
    elif word is None:
        note += " (fits, not tried)" if est.fits else " (does not fit)"
    if est.breakdown.allowance:
        note += f", {format_bytes(est.breakdown.allowance)} allowance"
    return note


def memory_chart(page: Page) -> str:
    """Predicted memory per candidate stacked by kind, the measured peak, the device limit and
    the usable memory, and a byte axis. The CUDA allowance (hatched) and the limit can dwarf
    what a CPU-size model holds; then the axis breaks after the largest measured or predicted
    non-allowance bytes, and what lies beyond is drawn compressed, so the other kinds stay
    readable. A candidate predicted not to fit always ends past the usable line."""
    rows = _memory_rows(page)
    hw = page.hardware
    content = max(
        [1]
        + [e.gpu_peak - e.breakdown.allowance for _, _, e, m in rows if e and (e.fits or m)]
        + [m for _, _, _, m in rows if m is not None]
    )
    top = max([hw.gpu_memory, content] + [e.gpu_peak for _, _, e, _ in rows if e])
    x0 = label_column([s.candidate.label() for _, s, _, _ in rows])
    plot_w, bar_h, gap, head = 440.0, 18, 10, 48
    axis = _Axis(x0, plot_w, content, top)
    bottom = head + len(rows) * (bar_h + gap)
    notes = [_memory_note(k, s, e) for k, s, e, _ in rows if e is not None]
    notes_x = axis.end + 10
    title = "Per-rank GPU memory: predicted (stacked by kind; faint: never launched) and measured "
    title += "peak (black tick)"
    width = max(
        notes_x + max((text_width(n, SMALL) for n in notes), default=0.0) + 12,
        x0 + text_width(title, FONT, bold=True) + 12,
    )
    body = _byte_grid(axis, head, bottom, top)
    for i, (kind, s, est, measured) in enumerate(rows):
        y = head + i * (bar_h + gap)
        body += _row_label(s.candidate.label(), kind, s, x0, y + 13)
        body += _memory_row(kind, s, est, measured, axis, hw, y, bar_h, notes_x)
    if axis.broken:
        body.append(_break_mark(axis.break_x, bottom - 4, 8))
    body += _limit_lines(hw, axis, head, bottom)
    legend, legend_end = _memory_legend(rows, axis, x0, width - x0, bottom + 30)
    return "\n".join([
        f'<svg id="chart-memory" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
        f'height="{legend_end + 10:.0f}" viewBox="0 0 {width:.0f} {legend_end + 10:.0f}" '
        'role="img" aria-label="memory per candidate">', PATTERNS,
        f'<text x="{x0:.1f}" y="16" class="t">{_esc(title)}</text>',
        *body, *legend, "</svg>",
    ])  # fmt: skip


def _byte_grid(axis: _Axis, head: float, bottom: float, top: float) -> list[str]:
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
        f'<line x1="{axis.x0:.1f}" x2="{axis.end:.1f}" y1="{bottom}" y2="{bottom}" stroke="#666"/>'
    )
    return out


def _memory_row(
    kind: str,
    s: Scored,
    est: MemoryEstimate | None,
    measured: int | None,
    axis: _Axis,
    hw: Hardware,
    y: float,
    bar_h: float,
    notes_x: float,
) -> list[str]:
    """One candidate's bars: its estimate stacked by kind (faint and outlined in its outcome's
    colour when it was never launched), the note at ``notes_x``, and its measured peak."""
    out: list[str] = []
    word = _word(kind, s)
    kept_out = never_launched(s) is not None
    faint = ' fill-opacity="0.35"' if kept_out else ""
    if est is not None:
        end = 0
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
        right = axis.x(est.gpu_peak)
        if not est.fits:  # past the usable line, whatever the compression
            right = max(right, axis.x(hw.usable_gpu_memory) + 6)
        if kept_out and word is not None:
            colour = OUTCOME_BY_WORD[word].colour
            out.append(
                f'<rect x="{axis.x0:.1f}" y="{y}" width="{right - axis.x0:.1f}" height="{bar_h}" '
                f'fill="none" stroke="{colour}" stroke-dasharray="3 2" data-bar="{_esc(word)}" '
                f'data-end="{right:.1f}"/>'
            )
        if axis.broken and est.gpu_peak > axis.cut:
            out.append(_break_mark(axis.break_x, y, bar_h))
        out.append(
            f'<text x="{notes_x:.1f}" y="{y + 13}" class="s note">'
            f"{_esc(_memory_note(kind, s, est))}</text>"
        )
    if measured is not None:
        mx = axis.x(measured)
        out.append(
            f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{y - 3}" y2="{y + bar_h + 3}" '
            f'stroke="#000" stroke-width="3"><title>measured {_esc(format_bytes(measured))}'
            "</title></line>"
        )
    return out


def _limit_lines(hw: Hardware, axis: _Axis, head: float, bottom: float) -> list[str]:
    """The device limit and the usable memory, as lines with their values."""
    out = []
    # Two labels side by side: the usable limit's ends at its line, the device's starts at its.
    for value, name, dash, anchor, dx in (
        (hw.gpu_memory, "device limit", "", "start", 3),
        (hw.usable_gpu_memory, "usable", ' stroke-dasharray="4 3"', "end", -3),
    ):
        lx = axis.x(value)
        out.append(
            f'<line x1="{lx:.1f}" x2="{lx:.1f}" y1="{head - 8}" y2="{bottom}" stroke="#c62828"'
            f' stroke-width="1.5"{dash} data-limit="{name}"/>'
            f'<text x="{lx + dx:.1f}" y="{head - 12}" text-anchor="{anchor}" class="s" '
            f'fill="#c62828">{name} {_esc(format_bytes(value))}</text>'
        )
    return out


def _memory_legend(
    rows: list[_MemoryRow], axis: _Axis, x0: float, width: float, legend_y: float
) -> tuple[list[str], float]:
    """Below the memory chart: what a broken axis compresses, a swatch per kind, a mark per
    outcome shown; and the y below it all."""
    out = []
    if axis.broken:
        allowance = any(e is not None and e.breakdown.allowance for _, _, e, _ in rows)
        line = (
            f"to scale up to {format_bytes(axis.cut)}; compressed beyond the break (//), where "
            + (
                "the allowance (hatched: CUDA context, NCCL, allocator slack, not measured by "
                "CPU trials) and "
                if allowance
                else ""
            )
            + "the device limit would squeeze the rest into a sliver"
        )
        for text in _wrapped(line, width):
            out.append(f'<text x="{x0:.1f}" y="{legend_y:.1f}" class="s dim">{_esc(text)}</text>')
            legend_y += 14
        legend_y += 4
    lx = x0
    for term, colour in KIND_COLOURS.items():
        name = term.replace("_", " ")
        entry = 13 + text_width(name, SMALL) + 12
        if lx > x0 and lx + entry > x0 + width:
            lx, legend_y = x0, legend_y + 18
        fill = "url(#hatch)" if term == "allowance" else colour
        out.append(
            f'<rect x="{lx:.1f}" y="{legend_y:.1f}" width="10" height="10" fill="{fill}"/>'
            f'<text x="{lx + 13:.1f}" y="{legend_y + 9:.1f}" class="s">{name}</text>'
        )
        lx += entry
    words = [w for kind, s, _, _ in rows if (w := _word(kind, s)) is not None]
    marks, end = outcome_legend(words, x0, legend_y + 22, width)
    return out + marks, end


def _wrapped(text: str, width: float) -> list[str]:
    """``text`` in lines no wider than ``width`` at the small size, cut at spaces."""
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if line and text_width(candidate, SMALL) > width:
            lines.append(line)
            line = word
        else:
            line = candidate
    return [*lines, line] if line else lines


# ---------------------------------------------------------------------------------------------
# Predicted against measured throughput
# ---------------------------------------------------------------------------------------------

# (kind, the candidate, predicted per GPU, measured per rank, unit) of each row of the speed chart
_SpeedRow = tuple[str, Scored, float | None, float | None, str]


def _speed_rows(page: Page) -> list[_SpeedRow]:
    """The rows of the speed chart: every candidate with a prediction or a measurement, but
    predictions of what cannot run (they would only squash the scale)."""
    rows = []
    for kind, s in page.rows:
        if s.estimate is not None and not s.estimate.fits and s.trial is None:
            continue
        if s.trial is not None and s.trial.status is TrialStatus.PRUNED:
            continue
        predicted, p_unit = predicted_per_rank(s, page.hardware)
        measured, m_unit = rate_per_rank(s.trial)
        if predicted or measured:
            rows.append((kind, s, predicted, measured, p_unit or m_unit))
    return rows


def speed_chart(page: Page) -> str:
    """Predicted against measured throughput of each candidate (per GPU, one rank's).

    Trials on the device planned for: both on one axis, the model's error beside. CPU trials
    while planning for GPUs: two panels with their own axes, since the two speak of different
    machines (the GPUs' prediction ranked; the CPU measurement only checked). A prediction
    for a candidate never launched is drawn hollow: no measurement stands beside it."""
    rows = _speed_rows(page)
    ran = [s.trial for _, s, _, _, _ in rows if s.trial is not None]
    shared = speed_basis(page.hardware, ran) == "trials"
    unit = next((u for *_, u in rows if u), "samples/s")
    where = next((t.device for t in ran if t.status is TrialStatus.OK), "")
    x0 = label_column([s.candidate.label() for _, s, _, _, _ in rows])
    panel_w, bar_h, gap, head = (460.0 if shared else 240.0), 9, 12, 76
    bottom = head + len(rows) * (2 * bar_h + gap)
    title = f"Throughput, {unit} per GPU (one rank's): predicted and measured"
    width = max(
        x0 + (panel_w if shared else 2 * panel_w + 40) + 90,
        x0 + text_width(title, FONT, bold=True) + 12,
    )
    out = [f'<text x="{x0:.1f}" y="16" class="t">{_esc(title)}</text>']
    key = [("predicted", PREDICTED, f"predicted for {page.device}", "solid")]
    if any(never_launched(s) for _, s, _, _, _ in rows):
        key.append(("predicted, never launched", PREDICTED, "predicted, never launched", "hollow"))
    key.append(("measured", MEASURED_BAR, f"measured{' on ' + where if where else ''}", "solid"))
    out += _bar_key(key, x0, 25, width - x0)
    if not rows:
        out.append(f'<text x="{x0:.1f}" y="{head}">no predictions or measurements</text>')
    for px, top, what in _speed_panels(rows, shared, x0, panel_w):
        scale = panel_w / top if top > 0 else 0.0
        title = {
            "both": "",
            "predicted": f"predicted for {page.device}",
            "measured": f"measured on {where or 'the trial device'} (own scale)",
        }[what]
        if title:
            out.append(f'<text x="{px:.1f}" y="{head - 14}" class="s" font-weight="bold">'
                       f"{_esc(title)}</text>")  # fmt: skip
        out += _rate_axis(px, top, scale, panel_w, head, bottom)
        for i, (_, s, predicted, measured, _) in enumerate(rows):
            y = head + i * (2 * bar_h + gap)
            out += _speed_bars(page, s, predicted, measured, what, px, top, scale, y, bar_h, unit)
    for i, (kind, s, _, _, _) in enumerate(rows):
        out += _row_label(
            s.candidate.label(), kind, s, x0, head + i * (2 * bar_h + gap) + bar_h + 4
        )
    words = [w for kind, s, _, _, _ in rows if (w := _word(kind, s)) is not None]
    marks, end = outcome_legend(words, x0, bottom + 30, width - x0)
    return "\n".join([
        f'<svg id="chart-speed" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
        f'height="{end + 10:.0f}" viewBox="0 0 {width:.0f} {end + 10:.0f}" role="img" '
        'aria-label="predicted against measured throughput">', PATTERNS, *out, *marks, "</svg>",
    ])  # fmt: skip


def _bar_key(
    entries: list[tuple[str, str, str, str]], x: float, y: float, width: float
) -> list[str]:
    """The speed chart's key: a swatch per kind of bar (solid or hollow) and what it is."""
    out, lx = [], x
    for name, colour, text, style in entries:
        entry = 14 + text_width(text, SMALL) + 18
        if lx > x and lx + entry > x + width:
            lx, y = x, y + 16
        fill = f'fill="{colour}"' if style == "solid" else f'fill="#fff" stroke="{colour}"'
        out.append(
            f'<rect x="{lx:.1f}" y="{y}" width="10" height="9" {fill} data-key="{_esc(name)}"/>'
            f'<text x="{lx + 14:.1f}" y="{y + 8}" class="s">{_esc(text)}</text>'
        )
        lx += entry
    return out


def _speed_panels(
    rows: list[_SpeedRow], shared: bool, x0: float, panel_w: float
) -> list[tuple[float, float, str]]:
    """(x, max, what) of each panel: one for both where they share a device, else one for the
    predictions and one for the measurements, each on its own scale."""
    if not rows:
        return []
    if shared:
        # Scaled to the measured rows; a prediction for a candidate that did not run may
        # reach past the axis, and is clipped with its value written beside.
        measured_rows = [(p or 0, m) for _, _, p, m, _ in rows if m]
        top = max(v for pair in measured_rows for v in pair) if measured_rows else 0.0
        top = top or max(p or 0 for _, _, p, _, _ in rows)
        return [(x0, top * 1.1, "both")]
    return [
        (x0, max(p or 0 for _, _, p, _, _ in rows) * 1.1 or 1.0, "predicted"),
        (x0 + panel_w + 40, max(m or 0 for _, _, _, m, _ in rows) * 1.1 or 1.0, "measured"),
    ]


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
    out.append(
        f'<line x1="{px:.1f}" x2="{px + panel_w:.1f}" y1="{bottom}" y2="{bottom}" stroke="#666"/>'
    )
    return out


def _speed_bars(
    page: Page,
    s: Scored,
    predicted: float | None,
    measured: float | None,
    what: str,
    px: float,
    top: float,
    scale: float,
    y: float,
    bar_h: float,
    unit: str,
) -> list[str]:
    """One row's bars in a panel showing ``what``, clipped at ``top``, and the text beside
    them: the model's error, the clipped value, or the spread of the ``measured`` rate."""
    kept_out = never_launched(s) is not None
    bars = []
    if what in ("both", "predicted") and predicted:
        style = f'fill="#fff" stroke="{PREDICTED}"' if kept_out else f'fill="{PREDICTED}"'
        name = "predicted, never launched" if kept_out else "predicted"
        bars.append((y, predicted, style, name))
    if what in ("both", "measured") and measured:
        bars.append((y + bar_h, measured, f'fill="{MEASURED_BAR}"', "measured"))
    out = []
    for by, value, style, name in bars:
        out.append(
            f'<rect x="{px:.1f}" y="{by}" width="{max(min(value, top) * scale, 0.5):.1f}" '
            f'height="{bar_h - 1}" {style} data-kind="{_esc(name)}"><title>{_esc(name)}: '
            f"{value:,.0f} {_esc(unit)}</title></rect>"
        )
    if not bars:
        return out
    end = min(max(v for _, v, _, _ in bars), top)
    error = prediction_error(s, page.hardware) if what == "both" else None
    text = error_text(s, error, page.rows) if error is not None else ""
    if any(v > top for _, v, _, _ in bars):
        text = f"▸ {max(v for _, v, _, _ in bars):,.0f}"
    if what == "measured" and s.trial is not None and measured:
        text = f"±{spread_of(s.trial):.0%}"
    if text:
        out.append(
            f'<text x="{px + end * scale + 4:.1f}" y="{y + bar_h + 4}" class="s">'
            f"{_esc(text)}</text>"
        )
    return out


# ---------------------------------------------------------------------------------------------
# Throughput against peak memory, every trial that ran
# ---------------------------------------------------------------------------------------------


def throughput_chart(page: Page) -> str:
    """Throughput against measured peak memory for every trial; failures on the axis; those
    never launched counted."""
    points = [(t, t.max_allocated, rate_per_rank(t)[0]) for t in page.trials]
    ok = [(t, m, r) for t, m, r in points if t.status is TrialStatus.OK and m and r]
    unit = next((trial_rate(t)[1] for t, _, _ in ok), "samples/s")
    title = f"Throughput ({unit} per GPU, one rank's) against measured peak memory per rank"
    left, bottom_pad, top_pad, h = 80, 50, 30, 360
    w = max(760, round(left + text_width(title, FONT, bold=True) + 20))
    max_mem = max([m for _, m, _ in ok] + [1]) * 1.15
    max_rate = max([r for _, _, r in ok] + [1.0]) * 1.15
    pw, ph = w - left - 60, h - top_pad - bottom_pad

    def sx(m: float) -> float:
        return left + m / max_mem * pw

    def sy(r: float) -> float:
        return top_pad + ph - r / max_rate * ph

    out = [
        f'<text x="{left}" y="16" class="t">{_esc(title)}</text>',
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
    colour = OUTCOME_BY_WORD[MEASURED].colour
    for t, m, r in ok:
        chosen = t.candidate.label() == page.chosen
        out.append(
            f'<circle cx="{sx(m):.1f}" cy="{sy(r):.1f}" r="{8 if chosen else 5}" '
            f'fill="{"#2e7d32" if chosen else colour}" stroke="#000" '
            f'stroke-width="{2 if chosen else 0.5}" data-outcome="measured"><title>'
            f"{_esc(t.candidate.label())}: {r:,.0f} {unit} per rank, {_esc(format_bytes(m))}"
            "</title></circle>"
        )
        if chosen:
            out.append(f'<text x="{sx(m) + 11:.1f}" y="{sy(r) + 4:.1f}" class="s" '
                       'font-weight="bold">chosen</text>')  # fmt: skip
    failed = [t for t, _, _ in points if t.status.launched and t.status is not TrialStatus.OK]
    out += _failure_marks(failed, left, top_pad + ph - 8)
    out += _never_drawn(page, left + pw - 8, top_pad + ph - 8)
    if not ok:
        out.append(
            f'<text x="{left + pw / 2}" y="{top_pad + ph / 2}" text-anchor="middle">no measured '
            f"trials{' (chosen by estimate)' if page.chosen else ''}</text>"
        )
    words = [MEASURED] * bool(ok) + [FAILED] * bool(failed)
    marks, end = outcome_legend(words, left, h, pw)
    return "\n".join([
        f'<svg id="chart-throughput" xmlns="http://www.w3.org/2000/svg" width="{w}" '
        f'height="{end + 6:.0f}" viewBox="0 0 {w} {end + 6:.0f}" role="img" '
        'aria-label="throughput against peak memory">', PATTERNS, *out, *marks, "</svg>",
    ])  # fmt: skip


def _failure_marks(failed: list[TrialResult], left: float, y: float) -> list[str]:
    """A cross per failed trial along the throughput chart's axis, and how many failed."""
    out = [
        outcome_mark(
            FAILED,
            left + 14 + i * 14,
            y - 4,
            f"{t.candidate.label()}: {t.status.value}",
            'data-outcome="failed"',
        )
        for i, t in enumerate(failed)
    ]
    if failed:
        out.append(
            f'<text x="{left + 12 + len(failed) * 14}" y="{y}" class="s" '
            f'data-outcome="failed">{len(failed)} failed (oom / error / timeout)</text>'
        )
    return out


def _never_drawn(page: Page, right: float, y: float) -> list[str]:
    """How many candidates were never launched, by outcome: not drawn, only counted."""
    counts: dict[str, int] = {}
    for _, s in page.rows:
        if (kept := never_launched(s)) is not None:
            counts[kept[0]] = counts.get(kept[0], 0) + 1
    if not counts:
        return []
    said = " and ".join(f"{n} {word}" for word, n in counts.items())
    return [
        f'<text x="{right:.1f}" y="{y:.1f}" text-anchor="end" class="s dim" '
        f'data-outcome="never launched">{_esc(said)}: never launched, not drawn</text>'
    ]
