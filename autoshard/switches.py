"""Recipe switches (torch.compile, float8): each candidate's twins without them, and whether a
predicted gain from one stands out of the model's own error.

Without trials a switch is proposed only where the model can tell the gain it predicts from its
own error: the switch's predicted interval and its twin's do not overlap (the held-out bands of
:mod:`autoshard.predict.intervals`, by GPU generation, precision and model size); with trials,
its twin is measured too (:mod:`autoshard.study.order`). The first GPU run is why: float8
measured 2.35x slower than eager on a 1B model where the model predicted it faster,
torch.compile 1.25x faster where the model predicted nothing
(benchmarks/data/measured_gpu.json).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.config import Candidate
from autoshard.predict.intervals import overlap
from autoshard.results import MemoryEstimate

SWITCHES = ("compile", "float8")
"""The recipe switches whose effect the model predicts and a twin measures."""


def twins_of(candidate: Candidate) -> list[Candidate]:
    """The candidate without each recipe switch it has on, one switch off at a time.

    >>> from autoshard.config import Candidate
    >>> both = Candidate(compile=True, float8=True, engine="fsdp2")
    >>> [(c.compile, c.float8) for c in twins_of(both)]
    [(False, True), (True, False)]
    """
    return [
        candidate.model_copy(update={switch: False})
        for switch in SWITCHES
        if getattr(candidate, switch)
    ]


def twin_in(
    estimate: MemoryEstimate, switch: str, estimates: Sequence[MemoryEstimate]
) -> MemoryEstimate | None:
    """``estimate``'s fitting twin without ``switch`` among ``estimates`` (None: not planned,
    e.g. the switch was pinned on, or it does not fit)."""
    label = estimate.candidate.model_copy(update={switch: False}).label()
    return next((e for e in estimates if e.fits and e.candidate.label() == label), None)


def predicted_gain(estimate: MemoryEstimate, twin: MemoryEstimate) -> float:
    """How much faster ``estimate`` is predicted than ``twin`` (0.1: 10% more samples/s)."""
    if estimate.speed is None or twin.speed is None or not twin.speed.samples_per_s:
        return 0.0
    return estimate.speed.samples_per_s / twin.speed.samples_per_s - 1


def proven_switches(
    best: MemoryEstimate, estimates: Sequence[MemoryEstimate]
) -> tuple[MemoryEstimate, list[str]]:
    """``best`` (the first of ``estimates``, ranked), or, where a switch's predicted gain over
    ``best``'s twin without it is one the model cannot tell from its own error (their intervals
    overlap: :func:`~autoshard.predict.intervals.overlap`), the first ranked candidate without
    that switch; with one line per switch that says which and why, the gain always named as
    predicted, not measured."""
    lines = []
    # float8 first: compile's twin is then the one without float8 too, if float8 went
    for switch in reversed(SWITCHES):
        if not getattr(best.candidate, switch):
            continue
        twin = twin_in(best, switch, estimates)
        if twin is None or best.speed is None or twin.speed is None:
            continue
        gain = predicted_gain(best, twin)
        if overlap(best.speed, twin.speed):
            lines.append(
                f"{switch} off: with it the model predicts {gain:+.0%}, within its own error at "
                f"this model size on this GPU ({_interval(best)} with it, {_interval(twin)} "
                "without: the intervals overlap); a gain the model cannot tell from its error "
                "is not proposed without trials: run them to measure both"
            )
            best = twin
        else:
            lines.append(
                f"{switch} on: predicted {gain:.0%} faster than without it ({_interval(best)} "
                f"against {_interval(twin)}; predicted, not measured): run trials to measure both"
            )
    chosen = {switch: getattr(best.candidate, switch) for switch in SWITCHES}
    same = (e for e in estimates if all(getattr(e.candidate, k) == v for k, v in chosen.items()))
    return next(same, best), lines


def _interval(estimate: MemoryEstimate) -> str:
    assert estimate.speed is not None
    low, high = estimate.speed.interval_s or (estimate.speed.step_time_s,) * 2
    return f"{low:.3f}-{high:.3f} s/step"
