"""The report page (autoshard/ui/html.py): self-contained, with well-formed charts; every trial
listed; the notebook's views of estimates."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from autoshard.results import TrialStatus
from autoshard.ui.html import render_html
from autoshard.ui.report import listed_rows
from tests.test_emit import all_trials, candidate, make_rec, trial
from tests.ui.test_report import NS, chart


def test_html_is_self_contained_with_wellformed_charts() -> None:
    rec = make_rec()
    page = render_html(rec, all_trials(rec))
    assert "<script" not in page and "<link" not in page and "src=" not in page
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)
    svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
    charts = {ET.fromstring(svg).get("id"): ET.fromstring(svg) for svg in svgs}
    assert set(charts) == {"chart-memory", "chart-speed", "chart-throughput"}
    ns = "{http://www.w3.org/2000/svg}"
    # memory: one stacked segment per non-zero term of every estimate, and a tick per measurement
    segments = [r for r in charts["chart-memory"].iter(f"{ns}rect") if r.get("data-kind")]
    expected = sum(
        sum(1 for v in s.estimate.breakdown.model_dump().values() if v > 0)
        for s in (rec.chosen, *rec.runners_up, *rec.ruled_out)
        if s.estimate
    )
    assert len(segments) == expected
    ticks = [
        ln for ln in charts["chart-memory"].iter(f"{ns}line") if ln.find(f"{ns}title") is not None
    ]
    assert len(ticks) == sum(1 for t in all_trials(rec) if t.status is TrialStatus.OK)
    # throughput: one point per successful trial, the chosen one marked; each outcome drawn has
    # its legend entry with its own mark
    throughput = charts["chart-throughput"]
    points = [c for c in throughput.iter(f"{ns}circle") if c.get("data-outcome") == "measured"]
    assert len(points) == 4 and sum(p.get("r") == "8" for p in points) == 1
    legend = {t.get("data-legend") for t in throughput.iter(f"{ns}text") if t.get("data-legend")}
    assert legend == {"measured", "failed"}
    marks = {m.get("data-mark") for m in throughput.iter() if m.get("data-mark")}
    assert marks == {"measured", "failed"}


def test_every_trial_is_listed_even_if_the_recommendation_keeps_only_some() -> None:
    """Six successful trials, a recommendation that carries four runners-up (as older ones
    did): the table and the memory chart list all six."""
    rec = make_rec()
    extra = [trial(candidate(micro_batch_size=m), 0.3 + 0.01 * m) for m in (3, 5)]
    trials = [*all_trials(rec), *extra]
    page = render_html(rec, trials)
    table = re.search(r'<table id="configurations">.*?</table>', page, flags=re.S).group(0)
    for t in trials:
        assert t.candidate.label() in table
    marks = [
        ln
        for ln in chart(page, "chart-memory").iter(f"{NS}line")
        if ln.find(f"{NS}title") is not None
    ]
    assert len(marks) == sum(1 for t in trials if t.max_allocated) == 6


def test_notebook_views_of_estimates() -> None:
    """A notebook shows an estimate as one line or a small table, and a list of them with the
    recommended row marked."""
    from autoshard.ui.html import estimates_html

    rec = make_rec()
    estimates = [s.estimate for _, s in listed_rows(rec) if s.estimate is not None]
    first = estimates[0]
    text = repr(first)
    assert "\n" not in text and len(text) < 160 and first.candidate.label() in text
    page = first._repr_html_()
    assert "activations" in page and first.candidate.label() in page
    listing = estimates_html(estimates, rec.hardware, chosen=rec.chosen.candidate)
    rows = listing.split("<tr")[2:]
    marked = [r for r in rows if 'class="recommended"' in r]
    assert len(marked) == 1 and rec.chosen.candidate.label() + " \u2190 recommended" in marked[0]
