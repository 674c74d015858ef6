"""The one order of candidates, and its one seam: when two are a tie (:func:`tie`), and what a
tie decides (:func:`ranked`). Every door ranks by it: the estimate table and ``recommend()``
(:func:`autoshard.space.rank_candidates`), the study's trial order, the decision from trials
(:mod:`autoshard.decide`) and the study's objective in optuna (:func:`objective_value`).

The rule: the fastest leads, unless it is at risk (its headroom under :data:`NEAR_LIMIT` of the
usable memory, or CPU offload whose host memory no one checked) and a candidate tied with it is
not; then the fastest of those leads. Speed is never traded for headroom that is already
enough, nor for less than the noise. Two measurements tie within their spreads together
(:func:`autoshard.measure.compare`); two predictions within :data:`PREDICTED_TIE`. Prediction
intervals per class plug in at :func:`tie`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from autoshard.measure import spread_of, throughput
from autoshard.predict.factors import DEFAULT_FACTORS
from autoshard.results import MemoryEstimate, TrialResult
from autoshard.units import format_bytes

PREDICTED_TIE = 0.05
"""Two predicted rates closer than this fraction are a tie: the step-time model cannot order
candidates more finely than that (its median error against 50 published runs is 13%,
benchmarks/results/step_time_published.md). A tie does not by itself give way to headroom
(:func:`ranked`): only a faster candidate at risk (:data:`NEAR_LIMIT`, unchecked host memory)
yields to a tied one without that risk."""

NEAR_LIMIT = DEFAULT_FACTORS.pressure_margin
"""Headroom below this share of the usable memory is not enough: there the caching allocator's
retries slow a step (the speed model's ``pressure_margin``) and a peak a little above the
estimate runs out of memory. Above it, more headroom buys nothing worth any speed."""


def predicted_tie(rate: float, top: float) -> bool:
    """Whether a predicted ``rate`` is a tie with the fastest, ``top`` (:data:`PREDICTED_TIE`)."""
    return top - rate <= PREDICTED_TIE * top


def tie_rule_words() -> str:
    """The order of fitting candidates in words, as tables caption it."""
    return (
        f"fastest predicted first; one within {PREDICTED_TIE:.0%} of a faster one goes first "
        f"only where that one is near the memory limit (under {NEAR_LIMIT:.0%} of it to spare) "
        "or offloads to host memory not checked"
    )


T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

# Breaks exact ties of rate (equal predictions: two candidates bound by the same host floor) by
# headroom, folded into the study's objective so that optuna's best trial is the choice: at most
# this share of a rate, far below any difference the rule reads.
HEADROOM_TIEBREAK = 1e-12


@dataclass(frozen=True)
class Contender(Generic[T_co]):
    """One candidate as the decision weighs it: ``rate``, the throughput the decision ranks
    (measured or predicted, per GPU), known to within ``spread`` (relative; None: a prediction,
    whose resolution is :data:`~autoshard.space.PREDICTED_TIE`), and its memory headroom under
    the ``usable`` memory (measured or predicted). ``item``: the estimate or trial it stands for."""

    item: T_co
    label: str
    rate: float
    spread: float | None
    headroom: int
    usable: int
    offload_unchecked: bool = False

    @property
    def measured(self) -> bool:
        return self.spread is not None

    @property
    def risk(self) -> str | None:
        """Why this candidate may not hold up as planned, or None: headroom under
        :data:`~autoshard.space.NEAR_LIMIT` of the usable memory, or CPU offload whose host
        memory no one checked."""
        if self.usable > 0 and self.headroom < NEAR_LIMIT * self.usable:
            return (
                f"near the memory limit ({format_bytes(max(self.headroom, 0))} of "
                f"{format_bytes(self.usable)} to spare)"
            )
        if self.offload_unchecked:
            return "offloads to host memory that was not checked"
        return None

    @property
    def noise(self) -> float:
        """The relative difference within which this rate ties another of its kind."""
        return 2 * self.spread if self.spread is not None else PREDICTED_TIE


def tie(a: Contender[object], b: Contender[object]) -> bool:
    """Whether ``a`` and ``b`` are as fast as far as can be told: the one seam of the rule
    (prediction intervals plug in here). Two measurements tie when their rates differ by less
    than their spreads together (:func:`autoshard.measure.compare`); a prediction ties within
    :data:`~autoshard.space.PREDICTED_TIE` of the faster.

    >>> def c(rate, spread=None):
    ...     return Contender(None, "", rate, spread, headroom=10, usable=100)
    >>> tie(c(100.0), c(95.0)), tie(c(100.0), c(94.0)), tie(c(100.0, 0.02), c(97.0, 0.02))
    (True, False, True)
    """
    if a.spread is not None and b.spread is not None:
        return abs(a.rate - b.rate) <= a.rate * a.spread + b.rate * b.spread
    return predicted_tie(min(a.rate, b.rate), max(a.rate, b.rate))


def speed_key(c: Contender[T]) -> tuple[float, int]:
    share = max(c.headroom, 0) / c.usable if c.usable > 0 else 0.0
    return c.rate * (1 + HEADROOM_TIEBREAK * share), c.headroom


def ranked(contenders: Sequence[Contender[T]]) -> list[Contender[T]]:
    """Best first. The fastest left leads, unless it is at risk (:attr:`Contender.risk`) and
    a candidate tied with it (:func:`tie`) is not: then the fastest of those leads. Speed is
    never traded for headroom that is already enough, nor for less than the noise; equal rates
    go to more headroom. Repeated until none is left.

    >>> def c(label, rate, headroom, offload=False):
    ...     return Contender(None, label, rate, None, headroom, 100, offload_unchecked=offload)
    >>> [x.label for x in ranked([c("edge", 100.0, 2), c("roomy", 97.0, 40), c("low", 9.0, 60)])]
    ['roomy', 'edge', 'low']
    >>> [x.label for x in ranked([c("fast", 100.0, 10), c("roomy", 97.0, 40)])]
    ['fast', 'roomy']
    >>> [x.label for x in ranked([c("offload", 100.0, 40, offload=True), c("kept", 96.0, 10)])]
    ['kept', 'offload']
    """
    left = sorted(contenders, key=speed_key, reverse=True)
    out: list[Contender[T]] = []
    while left:
        pick = 0
        if left[0].risk is not None:
            pick = next(
                (i for i, c in enumerate(left) if i and c.risk is None and tie(left[0], c)), 0
            )
        out.append(left.pop(pick))
    return out


def objective_value(c: Contender[object]) -> float:
    """The study's objective for ``c``: its rate, less its noise where it is at risk (so that a
    tied candidate without the risk scores higher, as :func:`ranked` chooses), exact ties
    broken by headroom: optuna's best trial is the recommended one."""
    rate = c.rate * (1 - c.noise) if c.risk is not None else c.rate
    share = max(c.headroom, 0) / c.usable if c.usable > 0 else 0.0
    return rate * (1 + HEADROOM_TIEBREAK * share)


def estimate_contender(
    e: MemoryEstimate, *, host_memory_checked: bool = False
) -> Contender[MemoryEstimate]:
    """A predicted candidate: its predicted tokens/s per GPU (else samples/s), its predicted
    headroom."""
    speed = e.speed
    rate = 0.0
    if speed is not None:
        rate = float(speed.tokens_per_s_per_gpu or speed.samples_per_s)
    return Contender(
        e, e.candidate.label(), rate, None, e.headroom, e.gpu_peak + e.headroom,
        offload_unchecked=e.candidate.cpu_offload and not host_memory_checked,
    )  # fmt: skip


def trial_contender(
    t: TrialResult, usable: int, *, host_memory_checked: bool = False
) -> Contender[TrialResult]:
    """A measured candidate: its tokens/s (else samples/s) per rank with its spread, and the
    headroom its measured peak (reserved where larger) leaves under ``usable``."""
    peak = max([*t.peak_reserved, *t.peak_allocated], default=usable)
    return Contender(
        t, t.candidate.label(), throughput(t) / max(t.world_size, 1), spread_of(t),
        usable - peak, usable, t.candidate.cpu_offload and not host_memory_checked,
    )  # fmt: skip


def rank_estimates(
    estimates: Sequence[MemoryEstimate], *, host_memory_checked: bool = False
) -> list[MemoryEstimate]:
    """``estimates`` in the decision's order (:func:`ranked`)."""
    contenders = [estimate_contender(e, host_memory_checked=host_memory_checked) for e in estimates]
    return [c.item for c in ranked(contenders)]


def pair_noise(a: Contender[object], b: Contender[object]) -> float:
    """The relative difference within which ``a`` and ``b`` tie, as reasons quote it."""
    if a.spread is not None and b.spread is not None:
        return a.spread + b.spread
    return PREDICTED_TIE
