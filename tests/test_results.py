"""The data model's own behaviour (autoshard/results.py): a breakdown's total, a trial's rates
per rank and its peak, a timeline's peak event, and a decision in a few lines with its
candidates' outcomes counted. The model as the outputs write it: tests/ui/test_files.py
(report.json's schema), tests/ui/test_report.py."""

from __future__ import annotations

from autoshard.config import Candidate
from autoshard.results import (
    MemoryBreakdown,
    SpeedEstimate,
    StepTimeline,
    TimedEvent,
    TrialResult,
)
from tests.test_emit import make_rec


def test_a_breakdowns_total_is_every_term_the_allowance_included() -> None:
    terms = MemoryBreakdown.model_fields
    every = MemoryBreakdown(**{name: 2**i for i, name in enumerate(terms)})
    assert every.total == 2 ** len(terms) - 1  # each term counted once
    assert MemoryBreakdown(allowance=7).total == 7 and MemoryBreakdown().total == 0


def test_a_trials_rates_are_one_ranks_and_its_peak_the_largest_ranks() -> None:
    trial = TrialResult(candidate=Candidate(), status="ok", world_size=4, tokens_per_s=1000.0,
                        samples_per_s=8.0, peak_allocated=(3, 9, 5, 1))  # fmt: skip
    assert (trial.tokens_per_s_per_gpu, trial.samples_per_s_per_gpu) == (250.0, 2.0)
    assert trial.max_allocated == 9
    assert trial.per_gpu == "per rank"  # CPU workers: not GPUs
    on_gpus = trial.model_copy(update={"device": "cuda"})
    assert on_gpus.per_gpu == "per GPU"
    bare = TrialResult(candidate=Candidate(), status="oom")
    assert bare.tokens_per_s_per_gpu is bare.samples_per_s_per_gpu is bare.max_allocated is None


def test_a_timelines_peak_event_is_the_one_it_points_at() -> None:
    def event(name: str, live: int) -> TimedEvent:
        return TimedEvent(name=name, stage="forward", micro_batch=0, turn=None, start_s=0.0,
                          end_s=1.0, live=MemoryBreakdown(activations=live))  # fmt: skip

    events = (event("a", 1), event("b", 3), event("c", 2))
    timeline = StepTimeline(candidate="c", events=events, peak=1, step_time_s=1.0)
    assert timeline.peak_event.name == "b"


def test_a_speed_line_says_its_rate_and_whether_it_is_calibrated() -> None:
    speed = SpeedEstimate(step_time_s=0.5, samples_per_s=4.0, tokens_per_s_per_gpu=12345.6,
                          calibrated=True)  # fmt: skip
    assert speed.describe() == "predicted 0.500 s/step, 12,346 tokens/s per GPU, calibrated"


def test_a_decision_counts_its_candidates_outcomes_in_words() -> None:
    rec = make_rec()  # the chosen and 3 runners-up measured, 1 out of memory, 1 ruled out
    assert rec.outcome_counts() == {"measured": 4, "diverged": 0, "failed": 1, "skipped": 0,
                                    "ruled out": 1}  # fmt: skip
    assert rec.outcome_words() == "4 measured (the chosen and 3 runners-up), 1 failed, 1 ruled out"
    estimate = make_rec(basis="estimate")  # nothing tried: the runners-up, and what overshoots
    assert estimate.outcome_counts()["measured"] == 0
    assert estimate.outcome_words() == "3 runners-up, 1 ruled out"


def test_a_decision_in_a_few_lines() -> None:
    rec = make_rec()
    lines = str(rec).splitlines()
    assert lines[0] == f"autoshard recommends {rec.chosen.candidate.label()}"
    assert lines[1].endswith("(1,872,640 params) on 1 x 2 GPUs of 2 GiB")
    assert lines[2] == "  predicted peak 0.98 GiB per GPU (analytic, 1.9 GiB usable)"
    assert lines[3] == (
        "  measured 0.228 s/step on 2 cpu ranks, 1,123 tokens/s per rank, peak 0.06 GiB"
    )
    assert lines[4].startswith("  basis: measured trials; 4 measured (the chosen and 3 ")
    assert repr(rec) == f"Recommendation({rec.chosen.candidate.label()!r}, basis='trials')"
