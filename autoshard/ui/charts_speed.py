"""report.html's speed chart: each candidate's predicted against measured throughput per GPU
(one rank's), on one axis where the trials ran on the device planned for, else in two panels."""

from __future__ import annotations

from typing import NamedTuple

from autoshard.measure import speed_basis, spread_of
from autoshard.results import Scored, TrialStatus
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
    error_text,
    never_launched,
    predicted_per_rank,
    prediction_error,
    rate_per_rank,
)
from autoshard.ui.textwidth import text_width
from autoshard.ui.ticks import nice_ticks

PREDICTED, MEASURED_BAR = "#f28e2b", "#4e79a7"

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
    out = [f'<text x="{x0:.1f}" y="16" class="t">{esc(title)}</text>']
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
                       f"{esc(title)}</text>")  # fmt: skip
        out += _rate_axis(px, top, scale, panel_w, head, bottom)
        panel = _Panel(px, top, scale, what, unit)
        for i, row in enumerate(rows):
            out += _speed_bars(page, row, panel, (head + i * (2 * bar_h + gap), bar_h))
    for i, (kind, s, _, _, _) in enumerate(rows):
        out += row_label(s.candidate.label(), kind, s, x0, head + i * (2 * bar_h + gap) + bar_h + 4)
    words = [w for kind, s, _, _, _ in rows if (w := outcome_word(kind, s)) is not None]
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
            f'<rect x="{lx:.1f}" y="{y}" width="10" height="9" {fill} data-key="{esc(name)}"/>'
            f'<text x="{lx + 14:.1f}" y="{y + 8}" class="s">{esc(text)}</text>'
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


class _Panel(NamedTuple):
    """One panel of the speed chart: its left ``x``, the rate at its right end (``top``: longer
    bars are clipped there), pixels per unit of rate, what it shows ("both", "predicted" or
    "measured") and the rate's unit."""

    x: float
    top: float
    scale: float
    what: str
    unit: str


def _speed_bars(page: Page, row: _SpeedRow, panel: _Panel, band: tuple[float, float]) -> list[str]:
    """One row's bars in the ``band`` (top y, height) of a ``panel``, clipped at its top, and
    the text beside them: the model's error, the clipped value, or the spread of the measured
    rate."""
    _, s, predicted, measured, _ = row
    px, top, scale, what, unit = panel
    y, bar_h = band
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
            f'height="{bar_h - 1}" {style} data-kind="{esc(name)}"><title>{esc(name)}: '
            f"{value:,.0f} {esc(unit)}</title></rect>"
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
            f'<text x="{px + end * scale + 4:.1f}" y="{y + bar_h + 4}" class="s">{esc(text)}</text>'
        )
    return out
