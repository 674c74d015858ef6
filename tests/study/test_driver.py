"""One run of a study (autoshard.study.driver.StudyRun): each trial tried with the run's memory
cap and an OOM retry where the candidate was predicted to fit, its failure classified; the
order refitted only when a new measurement came in; the prediction each trial is tried with."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from autoshard.config import Candidate, WorkloadSpec
from autoshard.options import TuneOptions
from autoshard.results import MemoryBreakdown, MemoryEstimate, TrialResult, TrialStatus
from autoshard.study import driver
from autoshard.study.dominance import dominated_by
from autoshard.study.driver import StudyRun

GIB = 2**30
FITS = Candidate(precision="32-true")
TIGHT = Candidate(precision="32-true", micro_batch_size=2)


def _estimate(c: Candidate, fits: bool) -> MemoryEstimate:
    return MemoryEstimate(
        candidate=c, method="analytic", gpu_peak=GIB, breakdown=MemoryBreakdown(), fits=fits,
        headroom=GIB if fits else -GIB, reason="" if fits else "needs 9 GiB per GPU",
    )  # fmt: skip


def _plan() -> Any:
    hardware = SimpleNamespace(usable_gpu_memory=3 * GIB, backend="gloo")
    estimates = [_estimate(FITS, True), _estimate(TIGHT, False)]
    return SimpleNamespace(hardware=hardware, estimates=estimates, workload=WorkloadSpec())


class _Group:
    def __init__(self, error: str | None = None) -> None:
        self.calls: list[tuple[str, int | None, bool]] = []
        self.error = error

    def run(
        self,
        candidate: Candidate,
        workload: WorkloadSpec,
        *,
        memory_cap: int | None = None,
        retry_oom: bool = False,
    ) -> TrialResult:
        self.calls.append((candidate.label(), memory_cap, retry_oom))
        status = TrialStatus.ERROR if self.error else TrialStatus.OK
        return TrialResult(candidate=candidate, status=status, error=self.error)


@pytest.mark.parametrize(("cap", "expected"), [(None, 3 * GIB), (GIB, GIB)])
def test_a_trial_runs_with_the_cap_and_a_retry_where_predicted_to_fit(cap, expected) -> None:
    group = _Group()
    run = StudyRun(_plan(), TuneOptions(memory_cap=cap), group)
    run.run(FITS)
    run.run(TIGHT)
    assert group.calls == [(FITS.label(), expected, True), (TIGHT.label(), expected, False)]


def test_a_trials_failure_is_classified_by_its_cause() -> None:
    full = "OSError: [Errno 28] No space left on device"
    result = StudyRun(_plan(), TuneOptions(), _Group(error=full)).run(FITS)
    assert result.transient  # a full disk is no fault of the configuration


def test_the_order_is_refitted_only_on_a_new_measurement(monkeypatch) -> None:
    fits: list[int] = []
    factors = SimpleNamespace(model_dump=lambda: {"compute": 1.5})
    calibration = SimpleNamespace(factors_for=lambda c: factors)

    def reorder_remaining(untried, done, plan):
        fits.append(len(done))
        return list(reversed(untried)), calibration

    monkeypatch.setattr(driver, "reorder_remaining", reorder_remaining)
    run = StudyRun(_plan(), TuneOptions(), _Group())
    queue = [e for e in run.plan.estimates]
    ran = TrialResult(candidate=FITS, status=TrialStatus.OK, step_time=0.5)
    assert run.factors_of(FITS) is None  # nothing predicted yet: the uncalibrated model's
    assert run.reorder(queue, [ran])[0].candidate == TIGHT
    run.reorder(queue, [ran])  # nothing new measured: no new fit
    assert fits == [1]
    assert run.factors_of(FITS) == {"compute": 1.5}
    slower = ran.model_copy(update={"step_time": 0.7})
    run.reorder(queue, [slower])
    assert fits == [1, 1]


def test_the_hooks_follow_the_options() -> None:
    hooks = StudyRun(_plan(), TuneOptions(), _Group()).hooks()
    assert hooks.dominated is dominated_by and hooks.reorder is not None
    full_grid = StudyRun(_plan(), TuneOptions(skip_dominated=False), _Group()).hooks()
    assert full_grid.dominated is None
