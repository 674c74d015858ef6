"""The chosen configuration's step as memory over time (a
:class:`~autoshard.results.StepTimeline`): an inline SVG chart for ``report.html`` and a table for
the terminal (``autoshard estimate --timeline``).
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import NamedTuple

from rich.console import Console

from autoshard.results import Decision, MemoryBreakdown, StepTimeline, TimedEvent
from autoshard.ui.fit import Column, fitted_table
from autoshard.ui.ticks import byte_ticks, nice_ticks
from autoshard.units import format_bytes

Scale = Callable[[float], float]  # seconds or bytes to pixels
_Level = tuple[float, float, int, list[TimedEvent]]  # a window: start, end, most live, events


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def seconds_unit(step_s: float) -> tuple[float, str]:
    """The scale and unit to print a step's times in: seconds, or milliseconds below one.

    >>> seconds_unit(2.5), seconds_unit(0.04)
    ((1.0, 's'), (1000.0, 'ms'))
    """
    return (1.0, "s") if step_s >= 1 else (1000.0, "ms")


def breakdown_line(live: MemoryBreakdown) -> str:
    """The kinds a moment holds, largest first (none of zero)."""
    terms = sorted(((v, k) for k, v in live.model_dump().items() if v > 0), reverse=True)
    return ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for v, k in terms)


def _levels(events: tuple[TimedEvent, ...]) -> list[_Level]:
    """(start, end, most live bytes, events) of each window the events take, in time order:
    the events of one FSDP unit's turn share its window."""
    out: list[_Level] = []
    for e in events:
        if out and (out[-1][0], out[-1][1]) == (e.start_s, e.end_s):
            start, end, most, those = out[-1]
            out[-1] = (start, end, max(most, e.live.total), [*those, e])
        else:
            out.append((e.start_s, e.end_s, e.live.total, [e]))
    return out


def _path(levels: list[_Level], x: Scale, y: Scale) -> str:
    """A step line through the windows' levels, held across the gaps between them."""
    parts = []
    for i, (start, end, most, _) in enumerate(levels):
        if i:  # held until this window starts, then up or down to its level
            parts.append(f"L{x(start):.1f},{y(levels[i - 1][2]):.1f}")
        parts.append(f"{'L' if i else 'M'}{x(start):.1f},{y(most):.1f}")
        parts.append(f"L{x(max(end, start)):.1f},{y(most):.1f}")
    return " ".join(parts)


def timeline_chart(rec: Decision) -> str:
    """Live GPU memory over the chosen configuration's step (no allowance), the peak marked with
    its name and breakdown, and the usable memory (less the peak's allowance) as a line where it
    is within reach of the curve; an empty string without a timeline."""
    timeline = rec.timeline
    if timeline is None or not timeline.events:
        return ""
    events = timeline.events
    peak = timeline.peak_event
    allowance = rec.chosen.estimate.breakdown.allowance if rec.chosen.estimate else 0
    room = rec.hardware.usable_gpu_memory - allowance  # what the live bytes may reach
    shown_limit = room <= 2.5 * peak.live.total  # else the curve would be a sliver
    top = max(peak.live.total, room if shown_limit else 0) * 1.1 or 1.0
    span = max(e.end_s for e in events) or 1.0
    scale, unit = seconds_unit(timeline.step_time_s)
    x0, w, head, h = 70, 640, 56, 200
    bottom = head + h
    frame = _Frame(x0, w, head, bottom, top, span, scale, unit)
    x, y = frame.x, frame.y

    out = [
        f'<svg id="chart-timeline" xmlns="http://www.w3.org/2000/svg" width="{x0 + w + 160}" '
        f'height="{bottom + 86}" role="img" aria-label="memory over the step">',
        f'<text x="{x0}" y="16" class="t">Live GPU memory over one step (predicted, before '
        "the allowance)</text>",
        f'<text x="{x0}" y="32" class="s dim">{_esc(timeline.candidate)}</text>',
    ]
    out += _axes(frame)
    out += _micro_batch_marks(events, x, head, bottom)
    if shown_limit:
        out.append(
            f'<line x1="{x0}" x2="{x0 + w}" y1="{y(room):.1f}" y2="{y(room):.1f}" '
            'stroke="#c62828" stroke-dasharray="4 3" data-limit="usable"/>'
            f'<text x="{x0 + 4}" y="{y(room) - 4:.1f}" class="s" fill="#c62828">usable '
            f"{_esc(format_bytes(room))} (less the allowance)</text>"
        )
    levels = _levels(events)
    out.append(f'<path d="{_path(levels, x, y)}" fill="none" stroke="#4e79a7" stroke-width="2"/>')
    for start, end, most, those in levels:  # each window's events, as a tooltip
        names = "; ".join(f"{e.name} {format_bytes(e.live.total)}" for e in those)
        out.append(
            f'<rect x="{x(start):.1f}" y="{y(most) - 4:.1f}" '
            f'width="{max(x(end) - x(start), 2):.1f}" height="8" fill="transparent">'
            f"<title>{_esc(names)}</title></rect>"
        )
    out += _peak_mark(timeline, frame)
    if not shown_limit:
        out.append(
            f'<text x="{x0}" y="{bottom + 78}" class="s dim">usable memory less the allowance, '
            f"{_esc(format_bytes(room))}, is off the chart: the peak takes "
            f"{peak.live.total / max(room, 1):.1%} of it</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


class _Frame(NamedTuple):
    """The timeline's plot: its left ``x0``, width ``w``, ``head`` and ``bottom`` (y), the bytes
    at its top and the seconds across it (``span``), and the time unit (``scale`` seconds to
    it) its axis counts in."""

    x0: float
    w: float
    head: float
    bottom: float
    top: float
    span: float
    scale: float
    unit: str

    def x(self, seconds: float) -> float:
        return self.x0 + self.w * seconds / self.span

    def y(self, live: float) -> float:
        return self.bottom - (self.bottom - self.head) * live / self.top


def _axes(frame: _Frame) -> list[str]:
    """The byte axis on the left, the time axis below."""
    x0, w, _, bottom, top, span, scale, unit = frame
    y = frame.y
    out = [f'<line x1="{x0}" x2="{x0 + w}" y1="{bottom}" y2="{bottom}" stroke="#666"/>']
    for tick in byte_ticks(top / 1.1):
        out.append(
            f'<line x1="{x0}" x2="{x0 + w}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" stroke="#eee"/>'
            f'<text x="{x0 - 6}" y="{y(tick) + 4:.1f}" text-anchor="end" class="s tick">'
            f"{_esc(format_bytes(tick))}</text>"
        )
    for tick in nice_ticks(span * scale, 8):
        tx = x0 + w * tick / (span * scale)
        out.append(
            f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#666"/>'
            f'<text x="{tx:.1f}" y="{bottom + 16}" text-anchor="middle" class="s">'
            f"{tick:g}</text>"
        )
    out.append(
        f'<text x="{x0 + w / 2}" y="{bottom + 32}" text-anchor="middle" class="s">{unit} into '
        "the step (the compute stream of the speed model's schedule)</text>"
    )
    return out


def _micro_batch_marks(
    events: tuple[TimedEvent, ...], x: Scale, head: float, bottom: float
) -> list[str]:
    """Where each micro-batch (after the first) and the optimizer step begin."""
    out = []
    starts: dict[str, float] = {}
    for e in events:
        key = "optimizer step" if e.stage == "step" else f"micro-batch {e.micro_batch}"
        starts.setdefault(key, e.start_s)
    for key, start in starts.items():
        if key == "micro-batch 0" or (key.startswith("micro") and len(starts) <= 2):
            continue
        out.append(
            f'<line x1="{x(start):.1f}" x2="{x(start):.1f}" y1="{head - 4}" y2="{bottom}" '
            f'stroke="#bbb" stroke-dasharray="2 3"/><text x="{x(start) + 3:.1f}" y="{head + 6}" '
            f'class="s dim">{_esc(key)}</text>'
        )
    return out


def _peak_mark(timeline: StepTimeline, frame: _Frame) -> list[str]:
    """A dot at the peak event and, below the axis, its name, time and breakdown."""
    x0, bottom, scale, unit = frame.x0, frame.bottom, frame.scale, frame.unit
    peak = timeline.peak_event
    px, py = frame.x(peak.start_s), frame.y(peak.live.total)
    where = f"micro-batch {peak.micro_batch}, " if timeline.events[-1].micro_batch else ""
    line = (
        f"peak {format_bytes(peak.live.total)} at {peak.name} ({where}{peak.start_s * scale:.3g}"
        f" {unit})"
    )
    return [
        f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#e15759" data-peak="{_esc(peak.name)}">'
        f"<title>{_esc(line)}</title></circle>",
        f'<text x="{px + 6:.1f}" y="{max(py - 6, 28):.1f}" class="s" fill="#e15759">'
        f"peak: {_esc(peak.name)}</text>",
        f'<text x="{x0}" y="{bottom + 48}" class="s" id="timeline-peak">{_esc(line)}:</text>',
        f'<text x="{x0}" y="{bottom + 62}" class="s">{_esc(breakdown_line(peak.live))}</text>',
    ]


def timeline_table(timeline: StepTimeline, width: int = 200) -> object:
    """Every event of the step in time order: micro-batch, stage, event, FSDP unit, start,
    duration, live bytes; the peak marked."""
    scale, unit = seconds_unit(timeline.step_time_s)
    columns = [Column("mb", "right", keep=3), Column("stage", keep=2),
               Column("event", keep=9, wrap=True), Column("unit", keep=1),
               Column(f"start {unit}", "right", keep=8),
               Column(f"duration {unit}", "right", keep=5),
               Column("live", "right", keep=9)]  # fmt: skip
    rows = []
    for i, e in enumerate(timeline.events):
        name = f"[bold]{e.name}[/] [red]← peak[/]" if i == timeline.peak else e.name
        start, duration = e.start_s * scale, (e.end_s - e.start_s) * scale
        rows.append([str(e.micro_batch), e.stage, name, e.turn or "", f"{start:.3f}",
                     f"{duration:.3f}", format_bytes(e.live.total)])  # fmt: skip
    untimed = ", ".join(f"{k} {v * scale:.3f} {unit}" for k, v in timeline.untimed.items() if v > 0)
    caption = (
        f"step {timeline.step_time_s * scale:.3f} {unit} (speed model"
        f"{', calibrated' if timeline.calibrated else ''}); off the turns: {untimed or 'nothing'}"
        f"; live bytes before the allowance; peak: {breakdown_line(timeline.peak_event.live)}"
    )
    return fitted_table(
        columns, rows, width, title=f"Step timeline: {timeline.candidate}", title_justify="left",
        caption=caption, caption_justify="left",
    )  # fmt: skip


def print_timeline(rec: Decision | None, console: Console) -> None:
    """The recommended configuration's timeline, or one line saying why there is none."""
    if rec is None or rec.timeline is None:
        console.print("[dim]no step timeline: no configuration was recommended[/]")
        return
    console.print(timeline_table(rec.timeline, console.width))
