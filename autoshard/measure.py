"""What a measured step time means: how precisely its median is known, when to stop timing, and
when two trials are a tie (what a tie then decides: :func:`autoshard.decide.ranked`).

The spread of a trial is the relative half-width of a distribution-free confidence interval of
the median step time (order statistics, about 95%). Why this and not the alternatives:

- the question the search asks is "is A faster than B", which is about how well each *median*
  is known; that shrinks as more steps are timed. IQR/median describes the scatter of single
  steps and does not shrink: a noisy machine would never get under the bound, and two medians
  timed over 40 steps would look as uncertain as over 3;
- order statistics assume nothing about the shape of the noise (step times are skewed: a GC
  pause or a neighbour's burst makes a long tail) and ignore outliers beyond the interval, as
  the median does; a mean +- t*sd does neither;
- a bootstrap gives nearly the same interval for the median, but needs random resampling, is
  unreliable below ~10 samples, and every rank must reach the same stop decision from the same
  numbers: a closed form is deterministic.

The interval [x_(k), x_(n+1-k)] of the sorted times covers the median with probability
1 - 2 P(Binomial(n, 1/2) < k); k is the largest index with coverage >= 95%. That needs n >= 6;
below, the full range is used (coverage 75% at 3 steps, 94% at 5), so the stopping rule keeps
timing until at least 6 steps unless the budget ends first.

>>> round(median_spread([1.00, 1.02, 0.99, 1.01, 1.00, 0.98, 1.03]), 3)
0.025
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from autoshard.config import (
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_STEPS,
    DEFAULT_TARGET_SPREAD,
    Hardware,
)
from autoshard.results import TrialResult, TrialStatus

CONFIDENCE = 0.95
MIN_STEPS_FOR_CONFIDENCE = 6  # the fewest samples whose order statistics reach 95% coverage


def _binomial_cdf_half(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_interval(times: Sequence[float]) -> tuple[float, float]:
    """A distribution-free ~95% confidence interval of the median of ``times`` (the full range
    below 6 samples, where no order-statistic interval reaches 95%)."""
    xs = sorted(times)
    n = len(xs)
    if n == 0:
        raise ValueError("no step times")
    k = 1  # 1-based: the interval [x_(k), x_(n+1-k)]
    while k + 1 <= n // 2 and 1 - 2 * _binomial_cdf_half(n, k) >= CONFIDENCE:
        k += 1
    return xs[k - 1], xs[n - k]


def median_spread(times: Sequence[float]) -> float:
    """Relative half-width of :func:`median_interval`: 0.03 means the median step time is known
    to within about 3%."""
    median = statistics.median(times)
    if median <= 0:
        return 0.0
    lo, hi = median_interval(times)
    return (hi - lo) / 2 / median


def enough_steps(
    times: Sequence[float],
    *,
    min_steps: int,
    target_spread: float = DEFAULT_TARGET_SPREAD,
    max_steps: int = DEFAULT_MAX_STEPS,
    max_seconds: float = DEFAULT_MAX_SECONDS,
) -> bool:
    """Whether to stop timing: at least ``min_steps``, and then either the median is known to
    within ``target_spread`` at 95% confidence or the budget (``max_steps`` timed steps or
    ``max_seconds`` of timed steps) is spent.

    >>> steady = [0.100, 0.101, 0.099, 0.100, 0.102, 0.100]
    >>> enough_steps(steady[:3], min_steps=3), enough_steps(steady, min_steps=3)
    (False, True)
    >>> noisy = [0.1, 0.2] * 10
    >>> enough_steps(noisy, min_steps=3), enough_steps(noisy, min_steps=3, max_steps=20)
    (False, True)
    """
    n = len(times)
    if n < max(1, min_steps):
        return False
    if n >= max_steps or sum(times) >= max_seconds:
        return True
    return n >= MIN_STEPS_FOR_CONFIDENCE and median_spread(times) <= target_spread


# ---------------------------------------------------------------------------------------------
# Comparing two trials
# ---------------------------------------------------------------------------------------------


def throughput(result: TrialResult) -> float:
    """The trial's measured rate: tokens/s where known, else samples/s (0 if it did not run)."""
    return float(result.tokens_per_s or result.samples_per_s or 0.0)


def spread_of(result: TrialResult) -> float:
    """The trial's relative spread: recorded, or computed from its step times (older records),
    or 0 when it has neither."""
    if result.step_time_spread is not None:
        return result.step_time_spread
    return median_spread(result.step_times) if result.step_times else 0.0


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing two measured trials: ``winner`` (the higher throughput) first.

    ``ratio`` is winner's throughput over loser's; ``noise`` the relative difference that the
    two spreads together allow; ``tie`` whether the difference is within it. What a tie decides
    is the decision's rule (:func:`autoshard.decide.ranked`), not this comparison's."""

    winner: TrialResult
    loser: TrialResult
    ratio: float
    noise: float
    tie: bool

    def describe(self) -> str:
        """'1.32x faster' or 'tie within noise (±6%)'."""
        if self.tie:
            return f"tie within noise (±{self.noise:.0%})"
        return f"{self.ratio:.2f}x faster"


def compare(a: TrialResult, b: TrialResult) -> Comparison:
    """Which of two successful trials is faster, and whether the difference is a tie.

    Each throughput is known to within its spread, so the two are a tie when their intervals
    overlap: ``|r_a - r_b| <= r_a * s_a + r_b * s_b`` (equal throughputs: ``a`` first).

    >>> from autoshard import Candidate, TrialResult
    >>> def run(mbs, step, spread):
    ...     return TrialResult(candidate=Candidate(micro_batch_size=mbs), status="ok",
    ...                        step_time=step, samples_per_s=mbs / step, step_time_spread=spread)
    >>> compare(run(1, 0.100, 0.03), run(2, 0.208, 0.03)).describe()
    'tie within noise (±6%)'
    >>> compare(run(1, 0.100, 0.01), run(2, 0.260, 0.01)).describe()
    '1.30x faster'
    """
    ra, rb = throughput(a), throughput(b)
    sa, sb = spread_of(a), spread_of(b)
    first, second = (a, b) if ra >= rb else (b, a)
    r1, r2 = throughput(first), throughput(second)
    return Comparison(
        winner=first,
        loser=second,
        ratio=r1 / r2 if r2 > 0 else math.inf,
        noise=sa + sb,
        tie=abs(ra - rb) <= ra * sa + rb * sb,
    )


def is_tie(a: TrialResult, b: TrialResult) -> bool:
    """Whether two trials' throughputs differ by less than their spreads together."""
    return compare(a, b).tie


# ---------------------------------------------------------------------------------------------
# Where the trials ran against what is planned
# ---------------------------------------------------------------------------------------------


def speed_basis(hardware: Hardware, trials: Sequence[TrialResult]) -> Literal["trials", "model"]:
    """What decides the speed order: the trials' timings when they ran on the kind of device
    planned for, the speed model when CPU processes stood in for the planned GPUs (a CPU's
    timings, and factors calibrated on them, say nothing about GPUs).

    >>> from autoshard import Candidate, Hardware, TrialResult
    >>> cpu_trial = [TrialResult(candidate=Candidate(), status="ok", device="cpu")]
    >>> speed_basis(Hardware(gpus_per_node=8, gpu_memory=80 * 2**30), cpu_trial)
    'model'
    >>> speed_basis(Hardware(gpus_per_node=2, gpu_memory=2**30, backend="gloo"), cpu_trial)
    'trials'
    """
    ran = [t for t in trials if t.status is TrialStatus.OK]
    planned_gpus = hardware.backend == "nccl"
    if planned_gpus and ran and all(t.device == "cpu" for t in ran):
        return "model"
    return "trials"


def trials_checked_line(hardware: Hardware, gpu: str | None = None) -> str:
    """The one line that says CPU trials checked the configurations and the model ranked them.

    >>> from autoshard import Hardware
    >>> line = trials_checked_line(Hardware(gpus_per_node=8, gpu_memory=80 * 2**30), "h100-sxm")
    >>> line.split("; ")[-1]
    "the speed order is the model's for 8 x h100-sxm"
    """
    name = gpu or hardware.gpu or "the planned GPU"
    return (
        "trials ran on CPU processes: they checked that configurations build, train and fit; "
        f"the speed order is the model's for {hardware.world_size} x {name}"
    )
