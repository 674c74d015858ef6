"""One run of a study, as the driver's loop sees it (:func:`autoshard.study.loop.run_trials`):
how a candidate is tried in the worker group, the order of the untried ones after each
measurement, and the prediction each trial is tried with (recorded with it).

The state a run keeps: each candidate's latest (calibrated) prediction, the one its trial is
tried with (the report puts it against its measurement; its factors time the chosen one's
timeline), and the calibration fitted on each set of measurements (a fit takes a second or two:
redone only when a new measurement came in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from autoshard.config import Candidate, WorkloadSpec
from autoshard.measure import speed_basis
from autoshard.options import TuneOptions
from autoshard.plan import Plan
from autoshard.predict.calibrate import Calibration, reorder_untried
from autoshard.predict.speed import SpeedFactors
from autoshard.results import MemoryEstimate, TrialResult, TrialStatus
from autoshard.sharding import cpu_workers_cannot_run
from autoshard.study.causes import classified
from autoshard.study.dominance import dominated_by
from autoshard.study.loop import TrialHooks
from autoshard.study.order import study_order

Fitted = tuple[list[MemoryEstimate], Calibration[SpeedFactors] | None]


class Group(Protocol):
    """What a run needs of :class:`autoshard.trials.group.WorkerGroup`."""

    def run(
        self,
        candidate: Candidate,
        workload: WorkloadSpec,
        *,
        memory_cap: int | None = None,
        retry_oom: bool = False,
    ) -> TrialResult: ...


class StudyRun:
    """The trials of ``plan`` tried in ``group`` with the trial settings of ``options``."""

    def __init__(self, plan: Plan, options: TuneOptions, group: Group) -> None:
        self.plan, self.options, self.group = plan, options, group
        hardware = plan.hardware
        self.memory_cap = (
            options.memory_cap if options.memory_cap is not None else hardware.usable_gpu_memory
        )
        self.fits = {e.candidate.label(): e.fits for e in plan.estimates}  # its OOM: tried again
        self.predicted: dict[str, SpeedFactors | None] = {}
        self.fitted: dict[tuple[object, ...], Fitted] = {}

    def hooks(self) -> TrialHooks:
        """The loop's hooks: this run's order and predictions, the dominance rules unless
        ``--no-skip-dominated``, and what CPU workers cannot run where there is no GPU."""
        return TrialHooks(
            dominated=dominated_by if self.options.skip_dominated else None,
            reorder=self.reorder,
            cannot_run=None if torch.cuda.is_available() else cpu_workers_cannot_run,
            factors_of=self.factors_of,
        )

    def run(self, candidate: Candidate) -> TrialResult:
        """One trial, its failure classified by cause; an OOM of a candidate predicted to fit
        is tried once more in a fresh group."""
        retry = self.fits.get(candidate.label(), False)
        result = self.group.run(
            candidate, self.plan.workload, memory_cap=self.memory_cap, retry_oom=retry
        )
        return classified(result)

    def factors_of(self, candidate: Candidate) -> dict[str, float] | None:
        """The calibrated factors ``candidate``'s latest prediction was made with (None: the
        uncalibrated model's)."""
        made_with = self.predicted.get(candidate.label())
        return None if made_with is None else made_with.model_dump()

    def reorder(
        self, untried: Sequence[MemoryEstimate], done: Sequence[TrialResult]
    ) -> list[MemoryEstimate]:
        """The untried candidates in the order to try them after ``done``
        (:func:`reorder_remaining`), each one's prediction kept for its trial."""
        key = (
            tuple(e.candidate.label() for e in untried),
            *sorted((r.candidate.label(), r.step_time) for r in done if r.step_time),
        )
        if key not in self.fitted:
            self.fitted[key] = reorder_remaining(untried, done, self.plan)
        order, calibration = self.fitted[key]
        for e in order:
            made_with = None if calibration is None else calibration.factors_for(e.candidate)
            self.predicted[e.candidate.label()] = made_with
        return order


def reorder_remaining(
    queue: Sequence[MemoryEstimate],
    done: Sequence[TrialResult],
    plan: Plan,
) -> tuple[list[MemoryEstimate], Calibration[SpeedFactors] | None]:
    """The untried candidates in the order to try them after the trials ``done``: the step-time
    model calibrated on the measured ones, fastest predicted first
    (:func:`autoshard.predict.calibrate.reorder_untried`), predicted ties first and each recipe
    switch with its twin (:func:`autoshard.study.order.study_order`).

    Only when the trials run on the kind of device planned for: CPU processes standing in for
    GPUs say nothing about the GPUs' speed (nor about a switch's), so their order stays the
    uncalibrated model's."""
    on_planned = plan.hardware.backend == "gloo" or torch.cuda.is_available()
    if not on_planned or speed_basis(plan.hardware, done) == "model":
        return list(queue), None
    if not any(r.status is TrialStatus.OK for r in done):
        return study_order(queue, done), None
    order, calibration = reorder_untried(
        queue, done, plan.speed.predict, plan.speed.prior, as_tried=plan.speed.predict_trial
    )
    return study_order(order, done), calibration
