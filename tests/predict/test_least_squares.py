"""The least squares calibrate fits its factors with (autoshard/predict/least_squares.py), on a
toy model whose answers are known by hand: which fields are factors, each factor's bounds, the
points' noise, and a solve that recovers a known factor or stops at its bound. The fit as
calibrate uses it: tests/predict/test_calibrate.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import Field

from autoshard.config import Candidate, Frozen
from autoshard.predict.least_squares import (
    MAX_RATIO_TO_PRIOR,
    NOISE_FLOOR,
    PRIOR_WEIGHT,
    Point,
    chi2_of,
    float_fields,
    log_bounds,
    noise_of,
    relevant_factors,
    rms_relative,
    solve,
)
from autoshard.results import SpeedEstimate


class Toy(Frozen):
    rate: float = Field(1.0, gt=0)  # divides the step: step = micro-batch / rate + fixed
    fixed: float = Field(0.5, ge=0, le=1)  # seconds added to every step
    margin: float = Field(0.05, ge=0, lt=1)  # read by nothing: the points cannot see it
    overlap: float = 1.0  # never fitted (the backend's structure)
    off: float = 0.0  # zero: not a factor to fit
    count: int = 3  # not a float


def predict(c: Candidate, f: Toy) -> SpeedEstimate:
    step = c.micro_batch_size / f.rate + f.fixed
    return SpeedEstimate(step_time_s=step, samples_per_s=c.micro_batch_size / step)


def points(rate: float, fixed: float, spread: float = 0.0) -> list[Point]:
    return [Point(Candidate(micro_batch_size=m), m / rate + fixed, spread) for m in (1, 2, 4, 8)]


def test_the_factors_are_the_positive_float_fields_but_overlap() -> None:
    assert float_fields(Toy()) == ["rate", "fixed", "margin"]
    assert float_fields(Toy(rate=2.0, fixed=0.0)) == ["rate", "margin"]


def test_a_factors_bounds_are_its_fields_limits_within_a_ratio_of_its_prior() -> None:
    assert MAX_RATIO_TO_PRIOR == 100.0
    lo, hi = log_bounds(Toy(), "rate")  # gt=0 only: the ratio decides both
    assert (math.exp(lo), math.exp(hi)) == (pytest.approx(0.01), pytest.approx(100.0))
    lo, hi = log_bounds(Toy(), "fixed")  # le=1 caps the ratio's 50
    assert (math.exp(lo), math.exp(hi)) == (pytest.approx(0.005), pytest.approx(1.0))
    _, hi = log_bounds(Toy(), "margin")  # lt=1: a hair inside it, never 1
    assert math.exp(hi) < 1.0 and math.exp(hi) == pytest.approx(1.0)


def test_noise_is_each_points_spread_floored_or_none_where_one_is_unknown() -> None:
    measured = [Point(Candidate(), 1.0, 0.002), Point(Candidate(), 1.0, 0.03)]
    assert noise_of(measured).tolist() == [NOISE_FLOOR, 0.03]  # type: ignore[union-attr]
    assert noise_of([*measured, Point(Candidate(), 1.0)]) is None
    assert noise_of([]) is None


def test_the_relative_error_is_the_root_mean_square_over_the_points() -> None:
    measured = [Point(Candidate(), 2.0), Point(Candidate(), 4.0)]
    assert rms_relative([2.2, 3.6], measured) == pytest.approx(0.1)  # +10% and -10%
    assert rms_relative([], []) == 0.0


def test_chi2_is_the_squared_log_errors_over_the_noise() -> None:
    measured = points(rate=2.0, fixed=0.5)
    noise = np.full(len(measured), 0.05)
    assert chi2_of(measured, predict, Toy(rate=2.0), noise) == pytest.approx(0.0, abs=1e-20)
    off = Toy(rate=2.0, fixed=0.6)
    expected = sum((math.log((p.step_time + 0.1) / p.step_time) / 0.05) ** 2 for p in measured)
    assert chi2_of(measured, predict, off, noise) == pytest.approx(expected)


def test_only_the_factors_the_points_can_see_are_relevant_dominant_first() -> None:
    # large micro-batches: the rate's term dominates the fixed seconds; the margin moves nothing
    assert relevant_factors(points(rate=1.0, fixed=0.5), predict, Toy()) == ["rate", "fixed"]
    fixed_bound = [Point(Candidate(micro_batch_size=1), 0.01 + 0.9, 0.0)]
    assert relevant_factors(fixed_bound, predict, Toy(rate=100.0, fixed=0.9)) == [
        "fixed",
        "rate",
    ]


def test_the_solve_recovers_a_known_factor_and_stops_at_its_bound() -> None:
    theta, cost = solve(points(rate=3.0, fixed=0.5), predict, Toy(), ["rate"], iterations=50)
    assert math.exp(theta[0]) == pytest.approx(3.0, rel=1e-2)  # the prior's pull is weak
    assert cost == pytest.approx(PRIOR_WEIGHT * math.log(3.0) ** 2, rel=1e-2)  # the pull alone
    both, _ = solve(points(rate=3.0, fixed=0.2), predict, Toy(), ["rate", "fixed"], 50)
    assert np.exp(both) == pytest.approx([3.0, 0.2], rel=2e-2)
    # a rate 1,000 times the prior's: at most MAX_RATIO_TO_PRIOR times it
    far, _ = solve(points(rate=1000.0, fixed=0.5), predict, Toy(), ["rate"], iterations=50)
    assert math.exp(far[0]) == pytest.approx(MAX_RATIO_TO_PRIOR)
    # nothing chosen: the prior's cost, no iteration
    none, start = solve(points(rate=3.0, fixed=0.5), predict, Toy(), [], iterations=50)
    assert none.size == 0 and start > cost
