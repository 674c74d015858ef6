"""The chosen step's memory over time (autoshard/ui/timeline.py): report.html draws it with its peak
and the usable memory to scale, and `autoshard estimate --timeline` prints its events."""

from __future__ import annotations

import re

import pytest

from autoshard.recommendation import Recommendation
from autoshard.ui.html import render_html
from tests.ui.test_report import NS, chart


@pytest.fixture(scope="module")
def planned_rec() -> Recommendation:
    """A decision made by the pipeline (so it carries the chosen configuration's timeline)."""
    import warnings

    import autoshard

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoshard.PlanWarning)
        return autoshard.recommend("examples/gpt.py:build", kwargs={"size": "tiny"}, gpus=8,
                                   gpu_memory="24GiB", seq_len=128, accumulate=2)  # fmt: skip


def test_the_report_draws_memory_over_the_chosen_step_with_its_peak(planned_rec) -> None:
    from autoshard.units import format_bytes

    timeline = planned_rec.timeline
    assert timeline is not None
    page = render_html(planned_rec)
    svg = chart(page, "chart-timeline")
    peak = timeline.peak_event
    dots = [c for c in svg.iter(f"{NS}circle") if c.get("data-peak")]
    assert [d.get("data-peak") for d in dots] == [peak.name]
    said = "".join(t.text or "" for t in svg.iter(f"{NS}text") if t.get("id") == "timeline-peak")
    assert peak.name in said and format_bytes(peak.live.total) in said
    # the dot sits on the line at the peak's height: the curve's highest point
    path = next(svg.iter(f"{NS}path")).get("d", "")
    ys = [float(p.split(",")[1]) for p in path.replace("M", "").split("L") if "," in p]
    assert min(ys) == pytest.approx(float(dots[0].get("cy", "nan")))
    # a tiny model on 24 GiB: the usable memory is off the chart, and the chart says so
    assert not [ln for ln in svg.iter(f"{NS}line") if ln.get("data-limit")]
    assert "is off the chart" in "".join(t.text or "" for t in svg.iter(f"{NS}text"))
    # within reach of the curve, the usable memory less the allowance is drawn as a line
    estimate = planned_rec.chosen.estimate
    assert estimate is not None
    room = int(1.5 * peak.live.total)
    gpu_memory = int((estimate.breakdown.allowance + room) / 0.95) + 1
    tight = planned_rec.model_copy(
        update={"hardware": planned_rec.hardware.model_copy(update={"gpu_memory": gpu_memory})}
    )
    svg = chart(render_html(tight), "chart-timeline")
    (limit,) = [ln for ln in svg.iter(f"{NS}line") if ln.get("data-limit") == "usable"]
    level = float(limit.get("y1", "nan"))
    base = max(float(ln.get("y1", "0")) for ln in svg.iter(f"{NS}line"))  # the time axis
    dot = float(next(svg.iter(f"{NS}circle")).get("cy", "nan"))
    usable = tight.hardware.usable_gpu_memory - estimate.breakdown.allowance
    # to scale: the line stands as far above the peak as its bytes are above the peak's
    assert (base - level) / (base - dot) == pytest.approx(usable / peak.live.total, rel=0.02)


def test_estimate_timeline_prints_the_chosen_steps_events(cli, planned_rec) -> None:
    code, out, err = cli("estimate", "examples/gpt.py:build", "--arg", "size=tiny", "--gpus",
                         "8", "--gpu-memory", "24GiB", "--seq-len", "128", "--accumulate", "2",
                         "--timeline")  # fmt: skip
    assert code == 0, err
    text = out.split("Step timeline: ")[1]
    assert planned_rec.timeline is not None  # recommend() for the same inputs: the same peak
    (marked,) = [line for line in text.splitlines() if "← peak" in line]
    assert planned_rec.timeline.peak_event.name in marked and "optimizer step" in text
    assert "accumulating" in text  # the second micro-batch's events
    assert re.search(r"step [\d.]+ m?s \(speed model\); off the turns:", " ".join(text.split()))
