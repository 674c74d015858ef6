"""report.html's speed chart (autoshard.ui.charts_speed): predicted against measured throughput,
read back from the rendered page, and what the terminal says beside it."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from rich.console import Console

from autoshard.config import Hardware
from autoshard.ui.html import render_html
from autoshard.ui.report import print_summary
from tests.ui.test_report import NS, GiB, all_trials, chart, make_rec, with_speeds


def test_speed_chart_puts_predicted_against_measured() -> None:
    """Trials on the device planned for: one axis, the model's error beside each trial."""
    rec = with_speeds(make_rec(hardware=Hardware(gpus_per_node=2, gpu_memory=2 * GiB,
                                                 backend="gloo")), "cpu-gloo")  # fmt: skip
    page = render_html(rec, all_trials(rec))
    speed = chart(page, "chart-speed")
    bars = [r for r in speed.iter(f"{NS}rect") if r.get("data-kind")]
    tried = [s for s in (rec.chosen, *rec.runners_up, *rec.ruled_out) if s.trial is not None]
    assert sum(r.get("data-kind") == "measured" for r in bars) == 4  # the OK trials
    assert sum(r.get("data-kind") == "predicted" for r in bars) == len(tried)
    labels = [t.text for t in speed.iter(f"{NS}text") if (t.text or "").startswith("model ")]
    s = rec.chosen
    expected = s.estimate.speed.tokens_per_s_per_gpu / (s.trial.tokens_per_s / 2) - 1
    assert labels[0] == f"model {expected:+.0%}" and len(labels) == 4
    assert "trials ran on CPU processes" not in page
    table = re.search(r'<table id="configurations">.*?</table>', page, flags=re.S).group(0)
    assert f"{expected:+.0%}" in table


def test_an_uncalibrated_prediction_beside_measured_ones_says_so() -> None:
    """A measured candidate whose prediction no trial of its class calibrated is marked, in the
    terminal and in the report's chart and table, and the calibrated ones are not."""
    hardware = Hardware(gpus_per_node=2, gpu_memory=2 * GiB, backend="gloo")
    plain = with_speeds(make_rec(hardware=hardware), "cpu-gloo")
    measured = [s for s in (plain.chosen, *plain.runners_up) if s.trial and s.trial.step_time]
    odd = measured[1].candidate.label()
    rec = with_speeds(make_rec(hardware=hardware), "cpu-gloo", uncalibrated=(odd,))
    page = render_html(rec, all_trials(rec))
    labels = [t.text for t in chart(page, "chart-speed").iter(f"{NS}text")]
    errors = [t for t in labels if (t or "").startswith("model ")]
    assert len(errors) == 4 and sum(t.endswith(", uncalibrated") for t in errors) == 1
    table = re.search(r'<table id="configurations">.*?</table>', page, flags=re.S).group(0)
    assert table.count(", uncalibrated") == 1
    console = Console(record=True, width=300)
    print_summary(rec, console=console, trials=all_trials(rec))
    text = console.export_text()
    row = next(line for line in text.splitlines() if odd in line)
    assert "uncalibrated)" in row
    assert text.count("uncalibrated)") == 1


def test_cpu_trials_for_gpus_show_two_scales_and_say_why() -> None:
    rec = with_speeds(make_rec(hardware=Hardware(gpus_per_node=2, gpu_memory=2 * GiB,
                                                 gpu="h100-sxm")), "h100-sxm", step=0.001)  # fmt: skip
    page = render_html(rec, all_trials(rec))
    assert "the speed order is the model&#x27;s for 2 x h100-sxm" in page
    text = ET.tostring(chart(page, "chart-speed"), encoding="unicode")
    assert "predicted for h100-sxm" in text and "measured on cpu (own scale)" in text
    assert "model " not in text  # a GPU prediction is no error of a CPU measurement
    console = Console(record=True, width=200)
    print_summary(rec, console, trials=all_trials(rec))
    summary = console.export_text()
    assert summary.count("the speed order is the model's for 2 x h100-sxm") == 1
