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
the model is any function ``(candidate, factors) -> SpeedEstimate``. The least squares, the
bounds and the noise rule: :mod:`autoshard.predict.least_squares`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic

import numpy as np
from torch import nn

from autoshard.config import Candidate, Hardware, RankOrder, WorkloadSpec
from autoshard.gpus import GPUSpec
from autoshard.predict.flops import FlopProfile, profile_flops
from autoshard.predict.hardware import speed_for
from autoshard.predict.intervals import Band, calibrated_band
from autoshard.predict.least_squares import (
    MIN_CHI2_DROP,
    F,
    Point,
    Predict,
    best_addition,
    chi2_of,
    log_step_times,
    noise_of,
    relevant_factors,
    rms_relative,
    solve,
    with_factors,
)
from autoshard.predict.optimizer_step import HOST_OPTIMIZER_THREADS
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
    before = [math.exp(v) for v in log_step_times(points, predict, prior)] if points else []
    pool = relevant_factors(points, predict, prior, names)
    chosen: list[str] = []
    theta = np.zeros(0)
    _, cost = solve(points, predict, prior, chosen, iterations) if points else (theta, 0.0)
    noise = noise_of(points)
    chi2 = chi2_of(points, predict, prior, noise) if noise is not None else math.inf
    limit = max(1, len(points) - 1)
    while pool and len(chosen) < limit and cost > 1e-12:
        singles = [(n,) for n in pool]
        step = best_addition(points, predict, prior, chosen, singles, iterations, noise)
        if step[2] > 0.8 * cost and len(chosen) + 2 <= limit and len(pool) >= 2:
            pairs = [(a, b) for i, a in enumerate(pool) for b in pool[i + 1 :]]
            step = best_addition(points, predict, prior, chosen, pairs, iterations, noise)
        added, t, c = step
        if c > 0.8 * cost:
            break
        if noise is not None:
            # What it explains must stand out of the points' noise; fitting noise moves
            # factors the untried candidates depend on (three CPU trials at one micro-batch,
            # each known to 3-5%, moved the collective latency to fit their 4% differences,
            # and the model then missed per-block trials at micro-batch 1 by 27%).
            explained = chi2_of(points, predict, with_factors(prior, [*chosen, *added], t), noise)
            if chi2 - explained < MIN_CHI2_DROP * len(added):
                break
            chi2 = explained
        chosen.extend(added)
        pool = [n for n in pool if n not in added]
        theta, cost = t, c
    factors = with_factors(prior, chosen, theta)
    after = [math.exp(v) for v in log_step_times(points, predict, factors)]
    return Calibration(
        factors=type(prior).model_validate(factors.model_dump()),
        fitted=tuple(chosen),
        points=points,
        predicted=tuple(after),
        error_before=rms_relative(before, points),
        error_after=rms_relative(after, points),
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
        refitted, predicted=tuple(after), error_after=rms_relative(after, points)
    )


# ---------------------------------------------------------------------------------------------
# Re-ranking the untried candidates
# ---------------------------------------------------------------------------------------------


def repredict(
    estimates: Sequence[MemoryEstimate],
    predict: Predict[F],
    factors: Callable[[Candidate], F],
    *,
    calibrated: bool | Callable[[Candidate], bool],
    band: Callable[[Candidate], Band | None] | None = None,
) -> list[MemoryEstimate]:
    """The estimates with their speed predicted again with each candidate's ``factors``, slowed
    where their predicted peak is near the usable memory
    (:func:`~autoshard.predict.speed.under_pressure`); ``calibrated`` (for each candidate,
    where a function) marks them, and ``band`` gives a calibrated candidate its interval
    (None: the held-out band the model gave it)."""
    out = []
    for e in estimates:
        speed = predict(e.candidate, factors(e.candidate))
        mark = calibrated(e.candidate) if callable(calibrated) else calibrated
        own = band(e.candidate) if band is not None and mark else None
        if own is not None:
            step = speed.step_time_s
            speed = speed.model_copy(
                update={
                    "interval_s": (step * own.low, step * own.high),
                    "interval_class": f"calibrated on {own.rows} trials",
                }
            )
        speed = speed.model_copy(update={"calibrated": mark})
        speed = under_pressure(speed, e.gpu_peak, e.gpu_peak + e.headroom)
        out.append(e.model_copy(update={"speed": speed}))
    return out


def class_band(calibration: Calibration[Any], candidate: Candidate) -> Band | None:
    """The band of ``candidate``'s calibration class: its group's trials' measured / predicted
    after the fit (:func:`~autoshard.predict.intervals.calibrated_band`); None where no trial
    of its group ran (precision, compile and float8: :func:`group_of`)."""
    group = group_of(candidate)
    pairs = [
        (p, predicted)
        for p, predicted in zip(calibration.points, calibration.predicted, strict=True)
        if group_of(p.candidate) == group and predicted > 0
    ]
    if not pairs:
        return None
    ratios = [p.step_time / predicted for p, predicted in pairs]
    spreads = [p.spread for p, _ in pairs]  # relative already
    return calibrated_band(ratios, spreads)


def order_by_speed(estimates: Sequence[MemoryEstimate]) -> list[MemoryEstimate]:
    """Fitting candidates fastest predicted first (ties: more headroom first), then the rest
    (:func:`autoshard.space.rank_candidates`, the one order of every door)."""
    return rank_candidates(estimates, RankOrder.SPEED)


def trial_host_threads() -> int:
    """Each trial rank's host threads: the caller's ``OMP_NUM_THREADS``, which the worker group
    passes on, else the group's own setting on GPUs (``HOST_OPTIMIZER_THREADS``,
    autoshard/trials/group.py)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else HOST_OPTIMIZER_THREADS


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
        """The run planned for (its host optimizer's threads: ``host_optimizer_threads``)."""
        return predict_speed(
            self.profile, self.flops, candidate, self.hardware, self.workload, factors,
            gpu=self.gpu, linears=self.linears,
        )  # fmt: skip

    def predict_trial(self, candidate: Candidate, factors: SpeedFactors) -> SpeedEstimate:
        """``candidate`` as autoshard's trials run it: each rank's host optimizer step on the
        worker group's threads (:func:`trial_host_threads`), what calibration compares with."""
        return predict_speed(
            self.profile, self.flops, candidate, self.hardware, self.workload, factors,
            gpu=self.gpu, linears=self.linears, host_threads=trial_host_threads(),
        )  # fmt: skip

    def attach(self, estimates: Sequence[MemoryEstimate]) -> list[MemoryEstimate]:
        """The estimates with the uncalibrated speed prediction."""
        return repredict(estimates, self.predict, lambda _: self.prior, calibrated=False)


def reorder_untried(
    untried: Sequence[MemoryEstimate],
    trials: Sequence[TrialResult],
    predict: Predict[F],
    prior: F,
    as_tried: Predict[F] | None = None,
) -> tuple[list[MemoryEstimate], Calibration[F]]:
    """Calibrate the model on the measured ``trials`` and re-rank the ``untried`` candidates
    with it: their speed estimates are replaced by the calibrated model's (``calibrated=True``
    once at least one trial was fitted), fastest predicted first. ``as_tried`` predicts a
    candidate as the trials ran it (:meth:`SpeedModel.predict_trial`: the worker group's host
    threads), what the fit compares with the measurements; ``predict`` (the run planned for)
    re-ranks the untried.

    Call it after each successful trial, with every trial so far: the fit starts from the
    prior each time, so the order never depends on the order the trials ran in. Trials of
    several precisions (or compile/float8 settings) refit each group's factors where they
    differ (:func:`fit_grouped`).
    """
    calibration = fit_grouped(points_of(trials), as_tried or predict, prior)
    fitted = bool(calibration.fitted or calibration.groups)
    measured = {group_of(p.candidate) for p in calibration.points}

    def calibrated(candidate: Candidate) -> bool:
        # a class without a trial of its own is predicted with the others' factors, but what
        # its recipe changes was never measured: not a peer of the measured classes
        return fitted and group_of(candidate) in measured

    again = repredict(
        untried, predict, calibration.factors_for, calibrated=calibrated,
        band=lambda c: class_band(calibration, c),
    )  # fmt: skip
    return order_by_speed(again), calibration
