"""report.html's charts as inline SVG (no script, no network): what they share, and
throughput against peak memory of every trial (:func:`throughput_chart`). Memory per candidate:
:mod:`autoshard.ui.charts_memory`; predicted against measured throughput:
:mod:`autoshard.ui.charts_speed`.

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
from autoshard.results import Decision, Scored, TrialResult, TrialStatus
from autoshard.ui.report import (
    FAILED,
    MEASURED,
    OUTCOME_BY_WORD,
    listed_rows,
    never_launched,
    outcome,
    predicted_device_of,
    rate_per_rank,
    trial_rate,
    trials_of,
)
from autoshard.ui.textwidth import text_width
from autoshard.units import format_bytes

FONT = 12.0  # svg text, px (the page's CSS)
SMALL = 11.0  # svg .s
MARK_W = 16.0  # the outcome mark's column, between a row's label and its bars


def esc(text: object) -> str:
    """``text`` safe inside an SVG element or attribute."""
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


def outcome_word(kind: str, s: Scored) -> str | None:
    """The outcome a row's mark shows: what became of the chosen and the runner-up, the
    ``kind`` itself where it is an outcome; None for a candidate never tried."""
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
    title = f"<title>{esc(title or word)}</title>"
    attrs = f'data-mark="{esc(word)}" {attrs}'.strip()
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
            f'<text x="{lx + 14:.1f}" y="{y + 9:.1f}" class="s" data-legend="{esc(word)}">'
            f"{esc(says)}</text>"
        )
        lx += entry
    return out, y + 18


def row_label(label: str, kind: str, s: Scored, right: float, y: float) -> list[str]:
    """A row's label, right-aligned at ``right`` (the chosen one bold), and its outcome mark."""
    weight = "bold" if kind == "chosen" else "normal"
    return [
        f'<text x="{right - MARK_W:.1f}" y="{y:.1f}" text-anchor="end" font-weight="{weight}" '
        f'class="label" data-outcome="{esc(kind)}">{esc(label)}</text>',
        outcome_mark(outcome_word(kind, s), right - MARK_W / 2, y - 4),
    ]


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
        f'<text x="{left}" y="16" class="t">{esc(title)}</text>',
        f'<rect x="{left}" y="{top_pad}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
    ]
    for k in range(5):
        m, r = max_mem * k / 4, max_rate * k / 4
        out.append(
            f'<text x="{sx(m):.1f}" y="{h - bottom_pad + 16}" text-anchor="middle" class="s">'
            f"{esc(format_bytes(m))}</text>"
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
            f"{esc(t.candidate.label())}: {r:,.0f} {unit} per rank, {esc(format_bytes(m))}"
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
        f'data-outcome="never launched">{esc(said)}: never launched, not drawn</text>'
    ]
