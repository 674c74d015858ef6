"""The study's trial order (autoshard.study.order): a recipe switch is never chosen on a
prediction alone, its twin without the switch is measured too (the GPU tune measured six
+compile candidates and no eager one); candidates the model cannot tell from the fastest are
tried before the rest."""

from __future__ import annotations

from autoshard.config import Candidate
from autoshard.results import MemoryBreakdown, MemoryEstimate, SpeedEstimate, TrialResult
from autoshard.study.order import study_order, ties_first, with_twins


def estimate(candidate: Candidate, step: float, band=(0.9, 1.1), fits=True) -> MemoryEstimate:
    speed = SpeedEstimate(
        step_time_s=step, samples_per_s=1 / step, interval_s=(step * band[0], step * band[1])
    )
    return MemoryEstimate(
        candidate=candidate, method="analytic", gpu_peak=1, breakdown=MemoryBreakdown(),
        fits=fits, headroom=1, speed=speed,
    )  # fmt: skip


def labels(order: list[MemoryEstimate]) -> list[str]:
    return [e.candidate.label() for e in order]


WRAP = ("m.Block",)
A = Candidate(wrap_classes=WRAP, micro_batch_size=2, compile=True)
B = Candidate(micro_batch_size=2, compile=True)
A_EAGER = A.model_copy(update={"compile": False})
B_EAGER = B.model_copy(update={"compile": False})


def test_each_switch_candidate_is_followed_by_its_twin() -> None:
    # the README's GPU tune: the compiled candidates predicted fastest, their twins last
    ranked = [estimate(A, 1.0), estimate(B, 1.05), estimate(A_EAGER, 2.0), estimate(B_EAGER, 2.1)]
    assert labels(with_twins(ranked)) == labels([ranked[0], ranked[2], ranked[1], ranked[3]])
    # a twin that does not fit is never pulled forward
    unfit = [estimate(A, 1.0), estimate(B, 1.05), estimate(A_EAGER, 2.0, fits=False)]
    assert labels(with_twins(unfit)) == labels(unfit)


def test_the_twin_of_a_measured_switch_comes_first() -> None:
    ranked = [estimate(B, 1.0), estimate(B_EAGER, 3.0), estimate(A_EAGER, 1.5), estimate(A, 4.0)]
    done = [TrialResult(candidate=A, status="ok", step_time=0.1)]
    order = with_twins(ranked, done)
    assert order[0].candidate == A_EAGER  # A ran: its eager twin is the missing comparison
    # a failed switch candidate teaches nothing about the switch: no urgency
    failed = [TrialResult(candidate=A, status="oom")]
    assert with_twins(ranked, failed)[0].candidate == B


def test_predicted_ties_are_tried_first() -> None:
    # C is predicted slower than D but its wide interval overlaps the fastest's: a tie
    top = estimate(Candidate(micro_batch_size=4), 1.0, (0.9, 1.1))
    wide = estimate(Candidate(micro_batch_size=1), 1.5, (0.6, 1.6))
    narrow = estimate(Candidate(micro_batch_size=2), 1.3, (0.9, 1.1))
    order = ties_first([top, narrow, wide])
    assert labels(order) == labels([top, wide, narrow])
    assert labels(study_order([top, narrow, wide])) == labels(order)
