"""report.html's memory chart: each candidate's predicted per-rank memory stacked by kind, its
measured peak, the device limit and the usable memory, on a byte axis that breaks where the
allowance or the limit would squeeze the rest into a sliver."""

from __future__ import annotations

from autoshard.config import Hardware
from autoshard.results import MemoryEstimate, Scored
from autoshard.ui.charts import (
    FONT,
    PATTERNS,
    SMALL,
    Page,
    esc,
    label_column,
    outcome_legend,
    outcome_word,
    row_label,
)
from autoshard.ui.report import (
    FAILED,
    KIND_COLOURS,
    OUTCOME_BY_WORD,
    RULED_OUT,
    SKIPPED,
    never_launched,
)
from autoshard.ui.textwidth import text_width
from autoshard.ui.ticks import byte_ticks
from autoshard.units import format_bytes


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
    word = outcome_word(kind, s)
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
        body += row_label(s.candidate.label(), kind, s, x0, y + 13)
        body += _memory_row((kind, s, est, measured), axis, hw, (y, bar_h), notes_x)
    if axis.broken:
        body.append(_break_mark(axis.break_x, bottom - 4, 8))
    body += _limit_lines(hw, axis, head, bottom)
    legend, legend_end = _memory_legend(rows, axis, x0, width - x0, bottom + 30)
    return "\n".join([
        f'<svg id="chart-memory" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
        f'height="{legend_end + 10:.0f}" viewBox="0 0 {width:.0f} {legend_end + 10:.0f}" '
        'role="img" aria-label="memory per candidate">', PATTERNS,
        f'<text x="{x0:.1f}" y="16" class="t">{esc(title)}</text>',
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
            f"{esc(format_bytes(tick))}</text>"
        )
    out.append(
        f'<line x1="{axis.x0:.1f}" x2="{axis.end:.1f}" y1="{bottom}" y2="{bottom}" stroke="#666"/>'
    )
    return out


def _memory_row(
    row: _MemoryRow, axis: _Axis, hw: Hardware, band: tuple[float, float], notes_x: float
) -> list[str]:
    """One candidate's bars in the ``band`` (top y, height): its estimate stacked by kind
    (faint and outlined in its outcome's colour when it was never launched), the note at
    ``notes_x``, and its measured peak."""
    kind, s, est, measured = row
    y, bar_h = band
    out: list[str] = []
    word = outcome_word(kind, s)
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
                f'fill="{fill}"{faint} data-kind="{term}"><title>{esc(term)}: '
                f"{esc(format_bytes(value))}</title></rect>"
            )
        right = axis.x(est.gpu_peak)
        if not est.fits:  # past the usable line, whatever the compression
            right = max(right, axis.x(hw.usable_gpu_memory) + 6)
        if kept_out and word is not None:
            colour = OUTCOME_BY_WORD[word].colour
            out.append(
                f'<rect x="{axis.x0:.1f}" y="{y}" width="{right - axis.x0:.1f}" height="{bar_h}" '
                f'fill="none" stroke="{colour}" stroke-dasharray="3 2" data-bar="{esc(word)}" '
                f'data-end="{right:.1f}"/>'
            )
        if axis.broken and est.gpu_peak > axis.cut:
            out.append(_break_mark(axis.break_x, y, bar_h))
        out.append(
            f'<text x="{notes_x:.1f}" y="{y + 13}" class="s note">'
            f"{esc(_memory_note(kind, s, est))}</text>"
        )
    if measured is not None:
        mx = axis.x(measured)
        out.append(
            f'<line x1="{mx:.1f}" x2="{mx:.1f}" y1="{y - 3}" y2="{y + bar_h + 3}" '
            f'stroke="#000" stroke-width="3"><title>measured {esc(format_bytes(measured))}'
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
            f'fill="#c62828">{name} {esc(format_bytes(value))}</text>'
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
            out.append(f'<text x="{x0:.1f}" y="{legend_y:.1f}" class="s dim">{esc(text)}</text>')
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
    words = [w for kind, s, _, _ in rows if (w := outcome_word(kind, s)) is not None]
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
