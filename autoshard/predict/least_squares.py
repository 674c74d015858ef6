"""Least squares on log step times over the factors of a step-time model: the machinery
:func:`autoshard.predict.calibrate.fit_factors` chooses its factors with.

- which factors the points can see (:func:`relevant_factors`: a measured step time moves by
  MIN_SENSITIVITY or more somewhere within the factor's bounds);
- each factor's bounds (:func:`log_bounds`: its field's declared limits, and within
  MAX_RATIO_TO_PRIOR of its prior);
- the bounded, damped solve with a weak pull towards the prior (:func:`solve`);
- the noise rule: each point's relative noise from its measured spread (:func:`noise_of`), the
  squared errors over it (:func:`chi2_of`), and which of several fits the noise cannot tell
  apart (:func:`best_addition`).

The factors are any frozen pydantic model of float fields; the model any function
``(candidate, factors) -> SpeedEstimate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import annotated_types
import numpy as np
from pydantic import BaseModel

from autoshard.config import Candidate
from autoshard.results import SpeedEstimate

F = TypeVar("F", bound=BaseModel)
Predict = Callable[[Candidate, F], SpeedEstimate]

# A point's noise is never taken below this (relative): timings repeat no better between trials.
NOISE_FLOOR = 0.01
# What one more fitted factor must explain, in squared errors over the points' noise: 3.84 is
# the 95% level of a chi-square with one degree of freedom (a likelihood-ratio test).
MIN_CHI2_DROP = 3.84
MIN_SENSITIVITY = 0.02  # d log(step time) / d log(factor) below this: the points cannot see it
PRIOR_WEIGHT = 1e-3  # ridge on log factors, against the sum of squared log errors
MAX_RATIO_TO_PRIOR = 100.0
_STEP = 0.05  # finite-difference step in log space
# Not speeds but the structure of the backend (how much communication may hide behind compute:
# 1 for NCCL's side streams, 0 for gloo): never fitted.
NOT_FITTED = frozenset({"overlap"})


@dataclass(frozen=True)
class Point:
    """One measured trial: the candidate, its measured seconds per step, and how well that is
    known (the relative half-width of the median's 95% interval, 0 where not measured)."""

    candidate: Candidate
    step_time: float
    spread: float = 0.0


def float_fields(factors: BaseModel) -> list[str]:
    """The factors that may be fitted: the positive float fields, but NOT_FITTED."""
    return [
        name
        for name, info in type(factors).model_fields.items()
        if info.annotation in (float, "float")
        and name not in NOT_FITTED
        and float(getattr(factors, name)) > 0
    ]


def log_bounds(factors: BaseModel, name: str) -> tuple[float, float]:
    """Log-space bounds of one factor: its field's declared limits, and a factor of
    MAX_RATIO_TO_PRIOR around its prior value."""
    prior = float(getattr(factors, name))
    lo, hi = prior / MAX_RATIO_TO_PRIOR, prior * MAX_RATIO_TO_PRIOR
    for limit in type(factors).model_fields[name].metadata:
        # An open bound (gt/lt) is approached, never reached: a hair inside it.
        if isinstance(limit, annotated_types.Le):
            hi = min(hi, float(limit.le))  # type: ignore[arg-type]
        elif isinstance(limit, annotated_types.Lt):
            hi = min(hi, float(limit.lt) * (1 - 1e-9))  # type: ignore[arg-type]
        elif isinstance(limit, annotated_types.Ge):
            lo = max(lo, float(limit.ge))  # type: ignore[arg-type]
        elif isinstance(limit, annotated_types.Gt):
            lo = max(lo, float(limit.gt) * (1 + 1e-9))  # type: ignore[arg-type]
    lo = max(lo, 1e-12)
    return math.log(lo), math.log(max(hi, lo))


def with_factors(factors: F, names: Sequence[str], logs: np.ndarray) -> F:
    return factors.model_copy(
        update={n: float(math.exp(v)) for n, v in zip(names, logs, strict=True)}
    )


def log_step_times(points: Sequence[Point], predict: Predict[F], factors: F) -> np.ndarray:
    return np.array([math.log(predict(p.candidate, factors).step_time_s) for p in points])


def rms_relative(predicted: Sequence[float], points: Sequence[Point]) -> float:
    if not points:
        return 0.0
    errs = [pred / p.step_time - 1 for pred, p in zip(predicted, points, strict=True)]
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def sensitivities(
    points: Sequence[Point], predict: Predict[F], factors: F, names: Sequence[str]
) -> np.ndarray:
    """``d log(step time) / d log(factor)`` for each point (rows) and factor (columns): about
    minus the share of the step that the factor divides."""
    base = log_step_times(points, predict, factors)
    logs = np.array([math.log(getattr(factors, n)) for n in names])
    out = np.zeros((len(points), len(names)))
    for j, name in enumerate(names):
        step = -_STEP if logs[j] + _STEP > log_bounds(factors, name)[1] else _STEP
        moved = logs.copy()
        moved[j] += step
        out[:, j] = (
            log_step_times(points, predict, with_factors(factors, names, moved)) - base
        ) / step
    return out


def relevant_factors(
    points: Sequence[Point], predict: Predict[F], prior: F, names: Sequence[str] | None = None
) -> list[str]:
    """The factors that change some point's predicted step time by at least MIN_SENSITIVITY
    (relative) somewhere within their bounds, dominant first (largest mean sensitivity at the
    prior). Judged at the bounds too, not only at the prior: a term that is negligible with the
    prior's value (a collective's latency of 30 us) may be what the measurements show (gloo's
    milliseconds)."""
    names = list(names) if names is not None else float_fields(prior)
    if not points or not names:
        return []
    base = log_step_times(points, predict, prior)
    sens = np.abs(sensitivities(points, predict, prior, names)).mean(axis=0)
    out = []
    for j, name in enumerate(names):
        effect = 0.0
        for bound in log_bounds(prior, name):
            moved = log_step_times(points, predict, with_factors(prior, [name], np.array([bound])))
            effect = max(effect, float(np.abs(moved - base).max()))
        if effect >= MIN_SENSITIVITY:
            out.append((sens[j], name))
    return [name for _, name in sorted(out, key=lambda t: -t[0])]


def solve(
    points: Sequence[Point], predict: Predict[F], prior: F, chosen: Sequence[str], iterations: int
) -> tuple[np.ndarray, float]:
    """Least squares on log step times over the ``chosen`` factors (log space), with the weak
    pull towards the prior and the bounds: (log factors, cost)."""
    measured = np.array([math.log(p.step_time) for p in points])
    theta0 = np.array([math.log(getattr(prior, n)) for n in chosen])
    bounds = np.array([log_bounds(prior, n) for n in chosen]).reshape(-1, 2)
    theta = np.clip(theta0, bounds[:, 0], bounds[:, 1])
    ridge = math.sqrt(PRIOR_WEIGHT)

    def residuals(t: np.ndarray) -> np.ndarray:
        model = log_step_times(points, predict, with_factors(prior, chosen, t)) - measured
        return np.concatenate([model, ridge * (t - theta0)])

    # Levenberg-Marquardt with a numerical Jacobian, projected onto the bounds: a handful of
    # parameters and points, a few model evaluations per point and iteration.
    damping = 1e-2
    r = residuals(theta)
    cost = float(r @ r)
    h = _STEP / 5
    for _ in range(iterations if len(chosen) else 0):
        jac = np.zeros((len(r), len(chosen)))
        for j in range(len(chosen)):
            # a step inwards at an upper bound: the factor must stay valid (le=1)
            hj = -h if theta[j] + h > bounds[j, 1] else h
            step = theta.copy()
            step[j] += hj
            jac[:, j] = (residuals(step) - r) / hj
        gram, grad = jac.T @ jac, jac.T @ r
        improved = converged = False
        while damping < 1e8:
            delta = np.linalg.solve(gram + damping * np.diag(np.diag(gram) + 1e-12), -grad)
            trial = np.clip(theta + delta, bounds[:, 0], bounds[:, 1])
            r_trial = residuals(trial)
            cost_trial = float(r_trial @ r_trial)
            if cost_trial < cost:
                converged = cost - cost_trial < 1e-6 * cost
                theta, r, cost, improved = trial, r_trial, cost_trial, True
                damping = max(damping / 3, 1e-9)
                break
            damping *= 4
        if not improved or converged:
            break
    return theta, cost


def noise_of(points: Sequence[Point]) -> np.ndarray | None:
    """Each point's relative noise: its spread, the half-width of a 95% interval (about two
    standard errors, so a cautious scale), or None when some point has no measured spread
    (then the fit cannot tell what is noise and stops by its improvement alone)."""
    if not points or any(p.spread <= 0 for p in points):
        return None
    return np.array([max(p.spread, NOISE_FLOOR) for p in points])


def chi2_of(points: Sequence[Point], predict: Predict[F], factors: F, noise: np.ndarray) -> float:
    """Squared log errors of ``factors``'s predictions, each over its point's noise."""
    measured = np.array([math.log(p.step_time) for p in points])
    r = (log_step_times(points, predict, factors) - measured) / noise
    return float(r @ r)


def best_addition(
    points: Sequence[Point],
    predict: Predict[F],
    prior: F,
    chosen: Sequence[str],
    options: Sequence[tuple[str, ...]],
    iterations: int,
    noise: np.ndarray | None = None,
) -> tuple[tuple[str, ...], np.ndarray, float]:
    """The option (factors to add) that fits best: (factors, log factors, cost). Options come
    dominant-first; the first whose fit the best one's cannot be told from wins: within 5% of
    its cost, or, where the points' noise is known, within MIN_CHI2_DROP of its chi2 (then the
    points cannot say which factor is off, and the one that weighs most in the step is the
    likeliest)."""
    tries = [(added, *solve(points, predict, prior, [*chosen, *added], iterations))
             for added in options]  # fmt: skip
    least = min(c for _, _, c in tries)
    if noise is None:
        return next(x for x in tries if x[2] <= least * 1.05 + 1e-15)
    chi2 = [
        chi2_of(points, predict, with_factors(prior, [*chosen, *a], t), noise) for a, t, _ in tries
    ]
    return next(x for x, c in zip(tries, chi2, strict=True) if c <= min(chi2) + MIN_CHI2_DROP)
