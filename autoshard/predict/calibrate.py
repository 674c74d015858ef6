"""Calibrate the step-time model with trials: fit its factors to what was measured, predict the
untried candidates again, and try the fastest predicted next.

The step-time model (:mod:`autoshard.predict.speed`) divides each part of a step by a factor
(compute by an efficiency, communication by a bandwidth factor, offload by a host factor, ...)
that datasheets cannot give. Each measured trial is one equation

    measured step time  ~=  predicted step time (factors)

and :func:`fit_factors` solves them in the least-squares sense, on log step times (relative
errors: a 10% miss on a 0.05 s step counts as much as on a 5 s step). The fit goes through the
model itself, not a linear sum of its breakdown terms, because the terms are not linear in the
factors (communication hidden behind compute is exposed only beyond it).

Robust with few points:
- a factor is a candidate for fitting only when some measured step time depends on it
  somewhere within its bounds (by 2% or more): a study with no CPU offload says nothing about
  the host factor, which keeps its prior;
- factors are added one at a time, the one that explains the measurements best first (among
  near-equals the dominant one, the largest share of the step), at most ``max(1, n - 1)`` with
  n points, and only while each lowers the error clearly: one trial fixes the overall speed
  through one factor, usually the compute efficiency;
- where the trials say how well their step times are known (the spread of each median), a
  factor is added only if what it explains stands out of that noise (a likelihood-ratio test:
  the squared errors over the noise drop by at least 3.84, chi-square's 95% level for one more
  parameter), and among factors whose fits the noise cannot tell apart, the dominant one;
- a weak pull towards the prior (ridge on log factors) keeps factors that the points cannot
  tell apart (two terms that always move together) near where they were;
- every factor stays within sane bounds: those its field declares (``le=1`` on an efficiency)
  and within a factor of 100 of its prior (gloo's collectives take milliseconds where NCCL's
  prior says 30 us).

The factors are any frozen pydantic model of float fields (the speed model's ``SpeedFactors``);
the model is any function ``(candidate, factors) -> SpeedEstimate``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import annotated_types
import numpy as np
from pydantic import BaseModel
from torch import nn

from autoshard.config import Candidate, Hardware, RankOrder, WorkloadSpec
from autoshard.gpus import GPUSpec
from autoshard.predict.flops import FlopProfile, profile_flops
from autoshard.predict.hardware import speed_for
from autoshard.predict.recipe import LinearShapes, linear_shapes
from autoshard.predict.speed import (
    SpeedFactors,
    default_factors,
    predict_speed,
    under_pressure,
)
from autoshard.results import (
    MemoryEstimate,
    ModelProfile,
    SpeedEstimate,
    TrialResult,
    TrialStatus,
)
from autoshard.space import rank_candidates

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


# What trials of different recipes can tell apart: their precision, torch.compile and float8 run
# different kernels (CPU bf16 matmuls and conversions, fused kernels, fp8 GEMMs), each at its own
# share of the hardware's peak.
Group = tuple[str, bool, bool]


def group_of(candidate: Candidate) -> Group:
    """The calibration group of a candidate: (precision, compile, float8)."""
    return candidate.precision.value, candidate.compile, candidate.float8


def describe_group(group: Group) -> str:
    precision, compiled, float8 = group
    return precision + (" +compile" if compiled else "") + (" +fp8" if float8 else "")


@dataclass(frozen=True)
class Calibration(Generic[F]):
    """What a fit found: the factors, which of them were fitted, and how well the model then
    matches the points it was fitted on; ``groups``: the factors refitted on one group's trials
    where they stand out of the shared fit (:func:`fit_grouped`)."""

    factors: F
    fitted: tuple[str, ...]
    points: tuple[Point, ...]
    predicted: tuple[float, ...]  # step times of the points with the fitted factors
    error_before: float  # root-mean-square relative error with the prior factors
    error_after: float
    groups: tuple[tuple[Group, Calibration[F]], ...] = ()

    def factors_for(self, candidate: Candidate) -> F:
        """The factors of ``candidate``'s group where its trials refitted them, else the
        shared ones."""
        return dict(self.groups).get(group_of(candidate), self).factors

    def describe(self) -> str:
        values = ", ".join(f"{k}={getattr(self.factors, k):.3g}" for k in self.fitted)
        text = (
            f"calibrated on {len(self.points)} trials ({values or 'nothing fitted'}): "
            f"step-time error {self.error_before:.0%} -> {self.error_after:.0%}"
        )
        for group, own in self.groups:
            values = ", ".join(f"{k}={getattr(own.factors, k):.3g}" for k in own.fitted)
            text += f"; {describe_group(group)} on its {len(own.points)} ({values})"
        return text


def points_of(trials: Sequence[TrialResult]) -> list[Point]:
    """The successful, timed trials as calibration points."""
    return [
        Point(t.candidate, t.step_time, t.step_time_spread or 0.0)
        for t in trials
        if t.status is TrialStatus.OK and t.step_time and t.step_time > 0
    ]


# ---------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------


def _float_fields(factors: BaseModel) -> list[str]:
    return [
        name
        for name, info in type(factors).model_fields.items()
        if info.annotation in (float, "float")
        and name not in NOT_FITTED
        and float(getattr(factors, name)) > 0
    ]


def _bounds(factors: BaseModel, name: str) -> tuple[float, float]:
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


def _with(factors: F, names: Sequence[str], logs: np.ndarray) -> F:
    return factors.model_copy(
        update={n: float(math.exp(v)) for n, v in zip(names, logs, strict=True)}
    )


def _log_times(points: Sequence[Point], predict: Predict[F], factors: F) -> np.ndarray:
    return np.array([math.log(predict(p.candidate, factors).step_time_s) for p in points])


def _rms_relative(predicted: Sequence[float], points: Sequence[Point]) -> float:
    if not points:
        return 0.0
    errs = [pred / p.step_time - 1 for pred, p in zip(predicted, points, strict=True)]
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def sensitivities(
    points: Sequence[Point], predict: Predict[F], factors: F, names: Sequence[str]
) -> np.ndarray:
    """``d log(step time) / d log(factor)`` for each point (rows) and factor (columns): about
    minus the share of the step that the factor divides."""
    base = _log_times(points, predict, factors)
    logs = np.array([math.log(getattr(factors, n)) for n in names])
    out = np.zeros((len(points), len(names)))
    for j, name in enumerate(names):
        step = -_STEP if logs[j] + _STEP > _bounds(factors, name)[1] else _STEP
        moved = logs.copy()
        moved[j] += step
        out[:, j] = (_log_times(points, predict, _with(factors, names, moved)) - base) / step
    return out


def relevant_factors(
    points: Sequence[Point], predict: Predict[F], prior: F, names: Sequence[str] | None = None
) -> list[str]:
    """The factors that change some point's predicted step time by at least MIN_SENSITIVITY
    (relative) somewhere within their bounds, dominant first (largest mean sensitivity at the
    prior). Judged at the bounds too, not only at the prior: a term that is negligible with the
    prior's value (a collective's latency of 30 us) may be what the measurements show (gloo's
    milliseconds)."""
    names = list(names) if names is not None else _float_fields(prior)
    if not points or not names:
        return []
    base = _log_times(points, predict, prior)
    sens = np.abs(sensitivities(points, predict, prior, names)).mean(axis=0)
    out = []
    for j, name in enumerate(names):
        effect = 0.0
        for bound in _bounds(prior, name):
            moved = _log_times(points, predict, _with(prior, [name], np.array([bound])))
            effect = max(effect, float(np.abs(moved - base).max()))
        if effect >= MIN_SENSITIVITY:
            out.append((sens[j], name))
    return [name for _, name in sorted(out, key=lambda t: -t[0])]


def _solve(
    points: Sequence[Point], predict: Predict[F], prior: F, chosen: Sequence[str], iterations: int
) -> tuple[np.ndarray, float]:
    """Least squares on log step times over the ``chosen`` factors (log space), with the weak
    pull towards the prior and the bounds: (log factors, cost)."""
    measured = np.array([math.log(p.step_time) for p in points])
    theta0 = np.array([math.log(getattr(prior, n)) for n in chosen])
    bounds = np.array([_bounds(prior, n) for n in chosen]).reshape(-1, 2)
    theta = np.clip(theta0, bounds[:, 0], bounds[:, 1])
    ridge = math.sqrt(PRIOR_WEIGHT)

    def residuals(t: np.ndarray) -> np.ndarray:
        model = _log_times(points, predict, _with(prior, chosen, t)) - measured
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


def _noise(points: Sequence[Point]) -> np.ndarray | None:
    """Each point's relative noise: its spread, the half-width of a 95% interval (about two
    standard errors, so a cautious scale), or None when some point has no measured spread
    (then the fit cannot tell what is noise and stops by its improvement alone)."""
    if not points or any(p.spread <= 0 for p in points):
        return None
    return np.array([max(p.spread, NOISE_FLOOR) for p in points])


def _chi2(points: Sequence[Point], predict: Predict[F], factors: F, noise: np.ndarray) -> float:
    """Squared log errors of ``factors``'s predictions, each over its point's noise."""
    measured = np.array([math.log(p.step_time) for p in points])
    r = (_log_times(points, predict, factors) - measured) / noise
    return float(r @ r)


def _best_addition(
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
    tries = [(added, *_solve(points, predict, prior, [*chosen, *added], iterations))
             for added in options]  # fmt: skip
    least = min(c for _, _, c in tries)
    if noise is None:
        return next(x for x in tries if x[2] <= least * 1.05 + 1e-15)
    chi2 = [_chi2(points, predict, _with(prior, [*chosen, *a], t), noise) for a, t, _ in tries]
    return next(x for x, c in zip(tries, chi2, strict=True) if c <= min(chi2) + MIN_CHI2_DROP)


def fit_factors(
    points: Sequence[Point],
    predict: Predict[F],
    prior: F,
    names: Sequence[str] | None = None,
    *,
    iterations: int = 30,
) -> Calibration[F]:
    """Fit the factors to measured step times (see the module docstring).

    ``names`` restricts the candidates for fitting (default: every positive float field of
    ``prior`` but NOT_FITTED). Factors are added one at a time (forward selection): each round
    adds the one that lowers the squared log error most (among near-equals, the dominant one),
    up to ``max(1, n - 1)`` factors, and stops when the next would lower it by less than a
    fifth, or, for points with a measured ``spread``, explain less than their noise (then
    among near-equals by that noise, the dominant factor is the one added). A round where no
    single factor helps tries pairs: two terms can pull in opposite directions (faster compute
    and slower collectives both, measured on 12 CPU trials), where either alone makes some
    points worse.
    """
    points = tuple(points)
    before = [math.exp(v) for v in _log_times(points, predict, prior)] if points else []
    pool = relevant_factors(points, predict, prior, names)
    chosen: list[str] = []
    theta = np.zeros(0)
    _, cost = _solve(points, predict, prior, chosen, iterations) if points else (theta, 0.0)
    noise = _noise(points)
    chi2 = _chi2(points, predict, prior, noise) if noise is not None else math.inf
    limit = max(1, len(points) - 1)
    while pool and len(chosen) < limit and cost > 1e-12:
        singles = [(n,) for n in pool]
        step = _best_addition(points, predict, prior, chosen, singles, iterations, noise)
        if step[2] > 0.8 * cost and len(chosen) + 2 <= limit and len(pool) >= 2:
            pairs = [(a, b) for i, a in enumerate(pool) for b in pool[i + 1 :]]
            step = _best_addition(points, predict, prior, chosen, pairs, iterations, noise)
        added, t, c = step
        if c > 0.8 * cost:
            break
        if noise is not None:
            # What it explains must stand out of the points' noise; fitting noise moves
            # factors the untried candidates depend on (three CPU trials at one micro-batch,
            # each known to 3-5%, moved the collective latency to fit their 4% differences,
            # and the model then missed per-block trials at micro-batch 1 by 27%).
            explained = _chi2(points, predict, _with(prior, [*chosen, *added], t), noise)
            if chi2 - explained < MIN_CHI2_DROP * len(added):
                break
            chi2 = explained
        chosen.extend(added)
        pool = [n for n in pool if n not in added]
        theta, cost = t, c
    factors = _with(prior, chosen, theta)
    after = [math.exp(v) for v in _log_times(points, predict, factors)]
    return Calibration(
        factors=type(prior).model_validate(factors.model_dump()),
        fitted=tuple(chosen),
        points=points,
        predicted=tuple(after),
        error_before=_rms_relative(before, points),
        error_after=_rms_relative(after, points),
    )


def fit_grouped(
    points: Sequence[Point],
    predict: Predict[F],
    prior: F,
    names: Sequence[str] | None = None,
    *,
    iterations: int = 30,
) -> Calibration[F]:
    """Fit the factors on all the points (:func:`fit_factors`), then, where trials of several
    groups ran (precision, compile, float8: :func:`group_of`), each group's again on its own
    points, starting from the shared fit: with the same rules (a factor only where it explains
    what the group's points show beyond their noise), so a group whose trials agree with the
    shared fit keeps it. A group without trials takes the shared factors."""
    points = tuple(points)
    shared = fit_factors(points, predict, prior, names, iterations=iterations)
    by_group: dict[Group, list[Point]] = {}
    for p in points:
        by_group.setdefault(group_of(p.candidate), []).append(p)
    if len(by_group) < 2:
        return shared
    groups = []
    for group, members in sorted(by_group.items()):
        own = fit_factors(members, predict, shared.factors, names, iterations=iterations)
        if own.fitted:
            groups.append((group, own))
    if not groups:
        return shared
    refitted = Calibration(
        factors=shared.factors, fitted=shared.fitted, points=points, predicted=(),
        error_before=shared.error_before, error_after=0.0, groups=tuple(groups),
    )  # fmt: skip
    after = [predict(p.candidate, refitted.factors_for(p.candidate)).step_time_s for p in points]
    return dataclasses.replace(
        refitted, predicted=tuple(after), error_after=_rms_relative(after, points)
    )


# ---------------------------------------------------------------------------------------------
# Re-ranking the untried candidates
# ---------------------------------------------------------------------------------------------


def repredict(
    estimates: Sequence[MemoryEstimate],
    predict: Predict[F],
    factors: Callable[[Candidate], F],
    *,
    calibrated: bool,
) -> list[MemoryEstimate]:
    """The estimates with their speed predicted again with each candidate's ``factors``, slowed
    where their predicted peak is near the usable memory
    (:func:`~autoshard.predict.speed.under_pressure`)."""
    out = []
    for e in estimates:
        speed = predict(e.candidate, factors(e.candidate))
        speed = speed.model_copy(update={"calibrated": calibrated})
        speed = under_pressure(speed, e.gpu_peak, e.gpu_peak + e.headroom)
        out.append(e.model_copy(update={"speed": speed}))
    return out


def order_by_speed(estimates: Sequence[MemoryEstimate]) -> list[MemoryEstimate]:
    """Fitting candidates fastest predicted first (ties: more headroom first), then the rest
    (:func:`autoshard.space.rank_candidates`, the one order of every door)."""
    return rank_candidates(estimates, RankOrder.SPEED)


@dataclass(frozen=True)
class SpeedModel:
    """The step-time model bound to one study: the model's profile and FLOPs, the hardware and
    workload planned for, the resolved catalogue entry, and the uncalibrated factors.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec, analyze_target
    >>> from autoshard.predict.calibrate import SpeedModel
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> model = SpeedModel.build(profile, built.model, Hardware(gpus_per_node=8,
    ...     gpu_memory=80 * 2**30, gpu="h100-sxm"), WorkloadSpec(seq_len=128))
    >>> model.predict(Candidate(), model.prior).gpu
    'h100-sxm'
    """

    profile: ModelProfile
    flops: FlopProfile
    hardware: Hardware
    workload: WorkloadSpec
    gpu: GPUSpec
    prior: SpeedFactors
    note: str = ""  # what was assumed about the GPU (said by the pipeline as a warning)
    linears: LinearShapes | None = None  # the layers float8 converts

    @classmethod
    def build(
        cls,
        profile: ModelProfile,
        meta_model: Any,
        hardware: Hardware,
        workload: WorkloadSpec,
        batch: Any = None,
    ) -> SpeedModel:
        """Count the FLOPs of ``meta_model`` (built on the meta device) and resolve the GPU."""
        flops = profile_flops(meta_model, profile, workload, batch=batch)
        gpu, note = speed_for(hardware)
        linears = linear_shapes(meta_model, profile) if isinstance(meta_model, nn.Module) else None
        return cls(profile, flops, hardware, workload, gpu, default_factors(gpu), note, linears)

    def predict(self, candidate: Candidate, factors: SpeedFactors) -> SpeedEstimate:
        return predict_speed(
            self.profile, self.flops, candidate, self.hardware, self.workload, factors,
            gpu=self.gpu, linears=self.linears,
        )  # fmt: skip

    def attach(self, estimates: Sequence[MemoryEstimate]) -> list[MemoryEstimate]:
        """The estimates with the uncalibrated speed prediction."""
        return repredict(estimates, self.predict, lambda _: self.prior, calibrated=False)


def reorder_untried(
    untried: Sequence[MemoryEstimate],
    trials: Sequence[TrialResult],
    predict: Predict[F],
    prior: F,
) -> tuple[list[MemoryEstimate], Calibration[F]]:
    """Calibrate the model on the measured ``trials`` and re-rank the ``untried`` candidates
    with it: their speed estimates are replaced by the calibrated model's (``calibrated=True``
    once at least one trial was fitted), fastest predicted first.

    Call it after each successful trial, with every trial so far: the fit starts from the
    prior each time, so the order never depends on the order the trials ran in. Trials of
    several precisions (or compile/float8 settings) refit each group's factors where they
    differ (:func:`fit_grouped`).
    """
    calibration = fit_grouped(points_of(trials), predict, prior)
    fitted = bool(calibration.fitted or calibration.groups)
    again = repredict(untried, predict, calibration.factors_for, calibrated=fitted)
    return order_by_speed(again), calibration
