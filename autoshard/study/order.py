"""The order a study tries its candidates in, beyond the fastest predicted first: the
candidates the model cannot tell from the fastest (their intervals overlap it:
:func:`autoshard.predict.intervals.overlap`) first, and every recipe switch (torch.compile,
float8) with its twin without the switch right after it, so that a switch is never chosen on
a prediction alone: the GPU showed why (``+compile`` candidates only were measured, the eager
twin never; float8 2.35x slower than eager where the model predicted it faster,
benchmarks/data/measured_gpu.json).
"""

from __future__ import annotations

from collections.abc import Sequence

from autoshard.predict.intervals import overlap
from autoshard.results import MemoryEstimate, TrialResult, TrialStatus
from autoshard.switches import twins_of


def ties_first(order: Sequence[MemoryEstimate]) -> list[MemoryEstimate]:
    """``order`` with the fitting candidates whose predicted interval overlaps the first
    fitting one's (a tie for the model) before those that do not; each part in its order."""
    fitting = [e for e in order if e.fits and e.speed is not None]
    if not fitting:
        return list(order)
    assert fitting[0].speed is not None
    top = fitting[0].speed
    tied = [e for e in fitting if e.speed is not None and overlap(e.speed, top)]
    chosen = {id(e) for e in tied}
    return tied + [e for e in order if id(e) not in chosen]


def with_twins(
    order: Sequence[MemoryEstimate], done: Sequence[TrialResult] = ()
) -> list[MemoryEstimate]:
    """``order`` with every switch candidate's fitting twins right after it (moved up from
    where they were), and first of all the untried twins of switch candidates that already
    ran: their comparison is the one still missing."""
    by_label = {e.candidate.label(): e for e in order}
    tried = {r.candidate.label() for r in done}
    measured = [r.candidate for r in done if r.status is TrialStatus.OK]
    urgent = [
        by_label[t.label()]
        for c in measured
        for t in twins_of(c)
        if t.label() in by_label and t.label() not in tried and by_label[t.label()].fits
    ]
    out: list[MemoryEstimate] = []
    placed: set[str] = set()

    def place(e: MemoryEstimate) -> None:
        if e.candidate.label() not in placed:
            placed.add(e.candidate.label())
            out.append(e)

    for e in urgent:
        place(e)
    for e in order:
        place(e)
        for twin in twins_of(e.candidate):
            other = by_label.get(twin.label())
            if other is not None and other.fits:
                place(other)
    return out


def study_order(
    order: Sequence[MemoryEstimate], done: Sequence[TrialResult] = ()
) -> list[MemoryEstimate]:
    """The order to try ``order``'s candidates in after the trials ``done``: predicted ties
    first (:func:`ties_first`), each switch with its twin (:func:`with_twins`)."""
    return with_twins(ties_first(order), done)
