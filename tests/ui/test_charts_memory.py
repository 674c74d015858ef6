"""report.html's memory chart (autoshard.ui.charts_memory), read back from the rendered page."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from autoshard.ui.html import render_html
from autoshard.units import parse_size
from tests.ui.test_report import NS, all_trials, chart, make_rec


def test_memory_chart_has_a_byte_axis_and_keeps_the_allowance_from_crowding_out_the_rest() -> None:
    rec = make_rec()  # a CPU-size model: 146 MiB of the chosen 1,004 MiB peak, the rest allowance
    memory = chart(render_html(rec, all_trials(rec)), "chart-memory")
    ticks = [
        (float(t.get("x")), 0 if t.text == "0 B" else parse_size(t.text.replace(" ", "")))
        for t in memory.iter(f"{NS}text")
        if "tick" in (t.get("class") or "")
    ]
    assert len(ticks) >= 3 and [v for _, v in ticks] == sorted(v for _, v in ticks)
    # the ticks lie on one linear scale, starting at 0 B
    (x0, v0), (x1, v1) = ticks[0], ticks[-1]
    assert v0 == 0
    scale = (x1 - x0) / v1
    assert all(abs(x - (x0 + v * scale)) < 0.6 for x, v in ticks)
    # the measured peaks sit on that scale
    marks = [ln for ln in memory.iter(f"{NS}line") if ln.find(f"{NS}title") is not None]
    measured = sorted(t.max_allocated for t in all_trials(rec) if t.max_allocated)
    assert sorted(float(ln.get("x1")) for ln in marks) == pytest.approx(
        [x0 + m * scale for m in measured], abs=0.6
    )
    # the chosen bar: what the CPU measured is readable (today's 15% of the bar: now > 20%),
    # the allowance hatched, and the compressed part of the axis said in words
    rects = [r for r in memory.iter(f"{NS}rect") if r.get("data-kind")]
    per_bar = len([v for v in rec.chosen.estimate.breakdown.model_dump().values() if v > 0])
    chosen = rects[:per_bar]
    allowance = [r for r in chosen if r.get("data-kind") == "allowance"]
    assert len(allowance) == 1 and allowance[0].get("fill") == "url(#hatch)"
    width = {r.get("data-kind"): float(r.get("width")) for r in chosen}
    rest = sum(w for k, w in width.items() if k != "allowance")
    assert rest / (rest + width["allowance"]) > 0.2
    assert "compressed beyond the break" in ET.tostring(memory, encoding="unicode")
