"""What report.html's charts share, and the throughput chart (autoshard/ui/charts.py): each
outcome's own mark, the legend (one entry per outcome, wrapped), the label column, and every
trial that ran drawn against its measured peak, failures on the axis, the rest counted. The
memory and speed charts: tests/ui/test_charts_memory.py, tests/ui/test_charts_speed.py."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from autoshard.outcomes import OUTCOMES
from autoshard.results import TrialStatus
from autoshard.ui.charts import (
    MARK_W,
    label_column,
    outcome_legend,
    outcome_mark,
    outcome_word,
    page_of,
    throughput_chart,
)
from tests.test_emit import all_trials, make_rec

NS = "{http://www.w3.org/2000/svg}"
SHAPES = {"solid": "circle", "outline": "circle", "diamond": "path", "cross": "path",
          "hatched": "rect"}  # fmt: skip


def svg(*parts: str) -> ET.Element:
    return ET.fromstring(f'<svg xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>')


def test_every_outcome_has_its_own_mark_and_a_never_tried_candidate_none() -> None:
    drawn = {}
    for o in OUTCOMES:
        (mark,) = list(svg(outcome_mark(o.word, 10.0, 20.0)))
        assert mark.tag == NS + SHAPES[o.mark], o
        assert mark.get("data-mark") == o.word and o.colour in ET.tostring(mark, "unicode")
        assert mark.findtext(f"{NS}title") == o.word  # its tooltip, unless given one
        drawn[o.word] = ET.tostring(mark, "unicode")
    assert len(set(drawn.values())) == len(OUTCOMES)  # no two outcomes look alike
    (solid,) = list(svg(outcome_mark("measured", 10.0, 20.0, "mbs2: 1,000 tokens/s")))
    assert (solid.get("cx"), solid.get("cy")) == ("10.0", "20.0")
    assert solid.findtext(f"{NS}title") == "mbs2: 1,000 tokens/s"
    assert outcome_mark(None, 10.0, 20.0) == ""


def test_a_rows_mark_is_its_outcome_and_the_label_column_fits_the_widest_label() -> None:
    rec = make_rec()
    page = page_of(rec, all_trials(rec))
    kinds = {kind: outcome_word(kind, s) for kind, s in page.rows}
    assert kinds == {"chosen": "measured", "runner-up": "measured", "failed": "failed",
                     "ruled out": "ruled out"}  # fmt: skip
    never_tried = rec.runners_up[0].model_copy(update={"trial": None})
    assert outcome_word("runner-up", never_tried) is None  # an estimate's runner-up
    assert label_column([]) == 12 + 6 + MARK_W
    short, long = label_column(["mbs1"]), label_column(["mbs1", "fsdp1 FULL_SHARD mbs1"])
    assert label_column([]) < short < long


def test_the_legend_says_each_outcome_once_and_wraps_at_its_width() -> None:
    words = ["measured", "failed", "measured", "skipped"]
    parts, below = outcome_legend(words, 0.0, 100.0, 2000.0)
    legend = [t.get("data-legend") for t in svg(*parts).iter(f"{NS}text")]
    assert legend == ["measured", "failed", "skipped"] and below == 118.0
    _, wrapped = outcome_legend(words, 0.0, 100.0, 60.0)  # one entry a line
    assert wrapped == 100.0 + 3 * 18


def test_the_throughput_chart_draws_what_ran_marks_the_choice_and_counts_the_rest() -> None:
    rec = make_rec()
    trials = all_trials(rec)
    chart = ET.fromstring(throughput_chart(page_of(rec, trials)))
    points = [c for c in chart.iter(f"{NS}circle") if c.get("data-outcome") == "measured"]
    ran = [t for t in trials if t.status is TrialStatus.OK]
    assert len(points) == len(ran) == 4
    (chosen,) = [p for p in points if p.get("r") == "8"]
    assert chosen.findtext(f"{NS}title", "").startswith(rec.chosen.candidate.label() + ":")
    # less memory lies further left: the points' x follow the trials' measured peaks
    xs = {p.findtext(f"{NS}title", "").split(":")[0]: float(p.get("cx", "0")) for p in points}
    by_memory = sorted(ran, key=lambda t: t.max_allocated or 0)
    assert sorted(xs, key=xs.__getitem__) == [t.candidate.label() for t in by_memory]
    texts = " ".join(t.text or "" for t in chart.iter(f"{NS}text"))
    failed = [t for t in trials if t.status.launched and t.status is not TrialStatus.OK]
    assert f"{len(failed)} failed (oom / error / timeout)" in texts
    assert "1 ruled out: never launched, not drawn" in texts
    # nothing measured: said in the plot
    nothing = ET.fromstring(throughput_chart(page_of(rec, failed)))
    said = " ".join(t.text or "" for t in nothing.iter(f"{NS}text"))
    assert "no measured trials (chosen by estimate)" in said
    assert not re.search(r'data-outcome="measured"', ET.tostring(nothing, "unicode"))
