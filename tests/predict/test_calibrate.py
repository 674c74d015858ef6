"""Calibration of the step-time model: the fit recovers known factors from synthetic
measurements, fits only what few points can determine, stays in bounds, and re-ranks the untried
candidates when a measurement says so."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import Field

from autoshard.config import Candidate, Frozen, Precision
from autoshard.predict.calibrate import (
    Point,
    fit_factors,
    fit_grouped,
    group_of,
    order_by_speed,
    relevant_factors,
    reorder_untried,
)
from autoshard.results import SpeedBreakdown, SpeedEstimate, TrialResult, TrialStatus
from tests.test_emit import estimate

from ..conftest import EXAMPLES


class Factors(Frozen):
    """A stand-in for the speed model's factors, with the same kind of bounds."""

    compute_efficiency: float = Field(0.5, gt=0, le=1.0)
    comm_efficiency: float = Field(0.8, gt=0, le=1.0)
    host_efficiency: float = Field(0.5, gt=0, le=1.0)


# Per candidate: FLOP seconds at peak, communication seconds at full bandwidth, offload seconds,
# by sharding / micro-batch / offload, as a step-time model would compute them.
def terms(c: Candidate) -> tuple[float, float, float]:
    compute = 0.02 * c.micro_batch_size * (1.33 if c.checkpointing.value == "all" else 1.0)
    comm = {"NO_SHARD": 0.004, "SHARD_GRAD_OP": 0.006, "FULL_SHARD": 0.009}[c.sharding.value]
    comm *= 1 if c.wrap_classes else 1.6
    offload = 0.03 if c.cpu_offload else 0.0
    return compute, comm, offload


def model(c: Candidate, f: Factors) -> SpeedEstimate:
    compute, comm, offload = terms(c)
    compute_s = compute / f.compute_efficiency
    # communication hides behind compute when the model is wrapped per block, not as one unit
    hidden = 0.8 * compute_s if c.wrap_classes else 0.0
    exposed = max(0.0, comm / f.comm_efficiency - hidden)
    step = compute_s + exposed + offload / f.host_efficiency
    return SpeedEstimate(
        step_time_s=step,
        samples_per_s=2 * c.micro_batch_size / step,
        breakdown=SpeedBreakdown(
            compute_s=compute_s, exposed_comm_s=exposed, offload_s=offload / f.host_efficiency
        ),
    )


def grid() -> list[Candidate]:
    out = []
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for mbs in (1, 4):
            for wrap in ((), ("gpt.Block",)):
                out.append(Candidate(sharding=sharding, micro_batch_size=mbs, wrap_classes=wrap))
    out.append(Candidate(cpu_offload=True, micro_batch_size=2))
    out.append(Candidate(cpu_offload=True, micro_batch_size=4, wrap_classes=("gpt.Block",)))
    return out


TRUE = Factors(compute_efficiency=0.3, comm_efficiency=0.25, host_efficiency=0.2)


def measure(cands: list[Candidate], factors: Factors = TRUE, noise: float = 0.0) -> list[Point]:
    rng = np.random.default_rng(0)
    return [Point(c, model(c, factors).step_time_s * math.exp(rng.normal(0, noise))) for c in cands]


def test_fit_recovers_known_factors_from_synthetic_measurements() -> None:
    points = measure(grid(), noise=0.01)
    calibration = fit_factors(points, model, Factors())
    assert set(calibration.fitted) == set(Factors.model_fields)
    for name in Factors.model_fields:
        assert getattr(calibration.factors, name) == pytest.approx(getattr(TRUE, name), rel=0.05)
    assert calibration.error_before > 0.3 and calibration.error_after < 0.02


def test_few_points_fit_only_the_dominant_factor() -> None:
    """One trial whose step is 80% compute and 20% exposed communication: one factor is fitted,
    the compute efficiency, and it explains the trial; the communication factor, which the same
    point cannot separate from it, keeps its prior. Nothing offloads: the host factor is never
    fitted, however many points."""
    one_unit = Candidate(sharding="SHARD_GRAD_OP", micro_batch_size=1)
    share = (
        model(one_unit, Factors()).breakdown.exposed_comm_s / model(one_unit, Factors()).step_time_s
    )
    assert 0.1 < share < 0.3
    calibration = fit_factors(measure([one_unit]), model, Factors())
    assert calibration.fitted == ("compute_efficiency",)
    assert calibration.factors.comm_efficiency == Factors().comm_efficiency
    assert calibration.error_after < 0.01
    two = fit_factors(measure([one_unit, Candidate(micro_batch_size=1)]), model, Factors())
    assert len(two.fitted) == 1  # two points: one factor
    no_offload = [c for c in grid() if not c.cpu_offload]
    assert relevant_factors(measure(no_offload), model, Factors()) == [
        "compute_efficiency",
        "comm_efficiency",
    ]


def test_three_trials_predict_the_other_nine() -> None:
    cands = [c for c in grid() if not c.cpu_offload]
    rng = np.random.default_rng(1)
    order = rng.permutation(len(cands))
    first, rest = [cands[i] for i in order[:3]], [cands[i] for i in order[3:]]
    calibration = fit_factors(measure(first, noise=0.02), model, Factors())
    assert len(calibration.fitted) == 2
    for c in rest:
        predicted = model(c, calibration.factors).step_time_s
        assert predicted == pytest.approx(model(c, TRUE).step_time_s, rel=0.25), c.label()


def test_what_the_noise_cannot_tell_is_not_fitted() -> None:
    """Trials carry how well their step time is known. Differences from the prior within that
    noise fit nothing; and where the points cannot tell which factor is off (comm_efficiency
    fits three exact points best, but within the noise of what compute_efficiency fits), the
    factor that weighs most in the step is fitted, and no second one."""
    cands = [c for c in grid() if not c.cpu_offload]
    three = [cands[0], cands[2], cands[4]]  # FULL_SHARD mbs 1 and 4, SHARD_GRAD_OP mbs 1
    truth = Factors(compute_efficiency=0.45, comm_efficiency=0.5)
    exact = [Point(c, model(c, truth).step_time_s) for c in three]
    assert fit_factors(exact, model, Factors()).fitted[0] == "comm_efficiency"
    noisy = [Point(p.candidate, p.step_time, spread=0.05) for p in exact]
    calibration = fit_factors(noisy, model, Factors())
    assert calibration.fitted == ("compute_efficiency",)
    assert calibration.factors.comm_efficiency == Factors().comm_efficiency
    # within 5% of the prior's prediction, each known to 5%: nothing to fit
    close = [
        Point(c, model(c, Factors()).step_time_s * wobble, spread=0.05)
        for c, wobble in zip(three, (1.03, 0.98, 1.04), strict=True)
    ]
    assert fit_factors(close, model, Factors()).fitted == ()
    unknown = [Point(p.candidate, p.step_time) for p in close]  # no spread: fitted as before
    assert fit_factors(unknown, model, Factors()).fitted != ()


def by_precision(c: Candidate) -> Factors:
    """The truth where bf16-mixed steps run at half fp32's compute rate (CPU bf16 kernels:
    issue 24's Llama-shaped grid measured about half the modelled rate)."""
    half = TRUE.compute_efficiency / 2
    return (
        TRUE.model_copy(update={"compute_efficiency": half})
        if c.precision.value != "32-true"
        else TRUE
    )


def test_each_precision_gets_its_own_fit_where_its_trials_differ() -> None:
    cands = [c for c in grid() if not c.cpu_offload]
    fp32 = [c.model_copy(update={"precision": Precision.FP32}) for c in cands]
    bf16 = [c.model_copy(update={"precision": Precision.BF16_MIXED}) for c in cands]
    tried = [fp32[0], fp32[3], fp32[5], bf16[1], bf16[2], bf16[4]]
    points = [Point(c, model(c, by_precision(c)).step_time_s, spread=0.03) for c in tried]
    grouped = fit_grouped(points, model, Factors())
    assert {group for group, _ in grouped.groups} >= {group_of(bf16[0])}
    untried = [c for c in fp32 + bf16 if c not in tried]
    for c in untried:  # each precision predicted by its own factors
        truth = model(c, by_precision(c)).step_time_s
        assert model(c, grouped.factors_for(c)).step_time_s == pytest.approx(truth, rel=0.1)
    # one fit for both misses one precision or the other by more than 25%
    shared = fit_factors(points, model, Factors())
    misses = [model(c, shared.factors).step_time_s / model(c, by_precision(c)).step_time_s - 1
              for c in untried]  # fmt: skip
    assert max(abs(m) for m in misses) > 0.25
    assert "bf16-mixed on its 3" in grouped.describe()
    # the study's re-ranking takes each candidate's group's factors
    estimates = [estimate(c) for c in untried]
    done = [TrialResult(candidate=p.candidate, status=TrialStatus.OK, step_time=p.step_time,
                        step_time_spread=p.spread) for p in points]  # fmt: skip
    ranked, calibration = reorder_untried(estimates, done, model, Factors())
    assert calibration.groups
    for e in ranked:
        assert e.speed is not None and e.speed.calibrated
        truth = model(e.candidate, by_precision(e.candidate)).step_time_s
        assert e.speed.step_time_s == pytest.approx(truth, rel=0.1)


def test_precisions_that_agree_share_one_fit() -> None:
    """Trials of two precisions measured as one model predicts them (within their noise): no
    group gets factors of its own."""
    cands = [c for c in grid() if not c.cpu_offload]
    fp32 = [
        c.model_copy(update={"precision": Precision.FP32}) for c in (cands[0], cands[3], cands[5])
    ]
    tried = [*fp32, cands[1], cands[2], cands[4]]  # bf16-mixed, the default
    rng = np.random.default_rng(2)
    points = [Point(c, model(c, TRUE).step_time_s * math.exp(rng.normal(0, 0.01)), spread=0.03)
              for c in tried]  # fmt: skip
    grouped = fit_grouped(points, model, Factors())
    assert len({group_of(c) for c in tried}) == 2
    assert grouped.groups == ()
    assert grouped.factors == fit_factors(points, model, Factors()).factors


def test_factors_stay_within_bounds() -> None:
    # A measurement 1000x slower than anything plausible: the efficiency stops at prior / 100;
    # one 3x faster than the model allows at full efficiency: it stops at its declared le=1.
    slow = [
        Point(
            Candidate(micro_batch_size=4),
            model(Candidate(micro_batch_size=4), TRUE).step_time_s * 1000,
        )
    ]
    assert fit_factors(slow, model, Factors()).factors.compute_efficiency == pytest.approx(
        0.5 / 100
    )
    quick_c = Candidate(micro_batch_size=4, sharding="NO_SHARD", wrap_classes=("b.B",))
    quick = [Point(quick_c, model(quick_c, Factors(compute_efficiency=1.0)).step_time_s / 3)]
    assert fit_factors(quick, model, Factors()).factors.compute_efficiency == pytest.approx(1.0)


def test_measurements_reorder_the_untried_candidates() -> None:
    """The prior assumes fast communication, so per-block FULL_SHARD at micro-batch 1 (its
    gathers hidden behind compute) is predicted fastest, ahead of the one-unit layout at
    micro-batch 4. Three trials show communication is 8x slower than assumed: the gathers no
    longer hide, and the calibrated model puts the larger micro-batch first."""
    prior = Factors(compute_efficiency=0.3, comm_efficiency=0.8)
    truth = prior.model_copy(update={"comm_efficiency": 0.1})
    per_block = Candidate(sharding="FULL_SHARD", micro_batch_size=1, wrap_classes=("b.B",))
    one_unit = Candidate(sharding="NO_SHARD", micro_batch_size=4)
    untried = order_by_speed(
        [estimate(c).model_copy(update={"speed": model(c, prior)}) for c in (one_unit, per_block)]
    )
    assert [e.candidate for e in untried] == [per_block, one_unit]
    ran = [
        Candidate(sharding="SHARD_GRAD_OP", micro_batch_size=1),
        Candidate(sharding="FULL_SHARD", micro_batch_size=1),
        Candidate(sharding="NO_SHARD", micro_batch_size=4, wrap_classes=("b.B",)),
    ]
    trials = [
        TrialResult(candidate=c, status=TrialStatus.OK, step_time=model(c, truth).step_time_s)
        for c in ran
    ]
    again, calibration = reorder_untried(untried, trials, model, prior)
    assert calibration.factors.comm_efficiency == pytest.approx(0.1, rel=0.02)
    assert [e.candidate for e in again] == [one_unit, per_block]
    assert all(e.speed and e.speed.calibrated for e in again)
    for e in again:  # the untried candidates carry the calibrated prediction
        assert e.speed.step_time_s == pytest.approx(model(e.candidate, truth).step_time_s, rel=0.02)
    # Failed trials calibrate nothing: the order and the predictions stay.
    failed = [t.model_copy(update={"status": TrialStatus.OOM}) for t in trials]
    same, nothing = reorder_untried(untried, failed, model, prior)
    assert nothing.fitted == () and [e.candidate for e in same] == [per_block, one_unit]
    assert not any(e.speed and e.speed.calibrated for e in same)


def test_a_calibrated_prediction_keeps_the_memory_pressure_slowdown() -> None:
    """A candidate predicted at the usable memory is slowed (allocator stalls) before and after
    the trials calibrate the model: recalibrating must not make it look 10% faster."""
    prior = Factors(compute_efficiency=0.3, comm_efficiency=0.8)
    at_limit = Candidate(sharding="NO_SHARD", micro_batch_size=4)
    base = estimate(at_limit)
    full = base.model_copy(update={"headroom": 0, "speed": model(at_limit, prior)})
    ran = [Candidate(sharding="FULL_SHARD", micro_batch_size=m) for m in (1, 4)]
    trials = [
        TrialResult(candidate=c, status=TrialStatus.OK, step_time=model(c, prior).step_time_s)
        for c in ran
    ]
    again, _ = reorder_untried([full], trials, model, prior)
    plain = model(at_limit, prior).step_time_s
    assert again[0].speed.step_time_s == pytest.approx(1.1 * plain, rel=1e-6)
    assert again[0].speed.breakdown.pressure_s == pytest.approx(0.1 * plain, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# In the study: the real step-time model, calibrated only on the device planned for
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_tiny():
    from autoshard import TargetSpec, analyze_target

    return analyze_target(TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"}))


def test_the_study_recalibrates_on_its_own_device_only(gpt_tiny, monkeypatch) -> None:
    """Trials on CPU processes planning for CPU processes (gloo) calibrate the model and
    re-rank; the same trials planning for GPUs change nothing (a CPU's speed says nothing about
    a GPU's)."""
    import autoshard.predict.hardware as hardware_module
    from autoshard.gpus import CATALOGUE

    # The catalogue's CPU entry as it stands, not this (busy, shared) machine's matmul timed
    # now: the prior's order must not depend on the load of the moment.
    monkeypatch.setattr(hardware_module, "measured_cpu", lambda ranks=1: CATALOGUE["cpu-gloo"])
    from autoshard import Hardware, WorkloadSpec
    from autoshard.predict.calibrate import SpeedModel
    from autoshard.study.driver import reorder_remaining

    profile, built = gpt_tiny
    workload = WorkloadSpec(seq_len=128)
    blocks = profile.wrap_policy
    # Per-block FULL_SHARD: more collectives, but each rank steps half the optimizer state.
    per_block = Candidate(wrap_classes=blocks, sharding="FULL_SHARD", micro_batch_size=1)
    one_unit = Candidate(sharding="NO_SHARD", micro_batch_size=1)
    cpu = Hardware(gpus_per_node=2, gpu_memory=8 * 2**30, backend="gloo")
    gpus = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30, gpu="h100-sxm")
    for hardware, reorders in ((cpu, True), (gpus, False)):
        speed = SpeedModel.build(profile, built.model, hardware, workload)
        queue = order_by_speed(speed.attach([estimate(per_block), estimate(one_unit)]))
        prior_order = [e.candidate for e in queue]

        def order(factors: object, speed=speed, cands=tuple(prior_order)) -> list[Candidate]:
            return sorted(cands, key=lambda x: -speed.predict(x, factors).samples_per_s)

        # A machine that differs from the prior in one factor, enough to swap the two: its
        # optimizer step streams memory 10x slower (helps per-block FULL_SHARD, which steps half
        # the state), or its collectives are 10x slower (helps the one unit, fewer of them).
        p = speed.prior
        truths = [
            p.model_copy(update={"memory_efficiency": p.memory_efficiency / 10}),
            p.model_copy(update={"comm_efficiency": p.comm_efficiency / 10}),
            p.model_copy(update={"collective_latency_s": p.collective_latency_s * 30}),
            # On the GPUs this tiny model's step waits on its host, FSDP's hooks most (one unit
            # first): a host that issues for free and an optimizer 100x slower swap them.
            p.model_copy(
                update={
                    "unit_host_scale": 0.0,
                    "op_overhead_s": 0.0,
                    "memory_efficiency": p.memory_efficiency / 100,
                }
            ),
        ]
        slow = next(t for t in truths if order(t) != prior_order)
        ran = [
            Candidate(wrap_classes=blocks, sharding=s, micro_batch_size=m)
            for s, m in (("NO_SHARD", 1), ("NO_SHARD", 4), ("FULL_SHARD", 2))
        ]
        trials = [
            TrialResult(candidate=c, status="ok", device="cpu", world_size=2,
                        step_time=speed.predict(c, slow).step_time_s)
            for c in ran
        ]  # fmt: skip
        plan = SimpleNamespace(hardware=hardware, speed=speed)  # what reordering reads
        again, calibration = reorder_remaining(queue, trials, plan)  # type: ignore[arg-type]
        if reorders:
            assert calibration is not None and calibration.fitted
            assert [e.candidate for e in again] == order(slow) == prior_order[::-1]
            assert all(e.speed is not None and e.speed.calibrated for e in again)
        else:
            assert calibration is None and again == queue


def test_a_class_without_a_trial_of_its_own_is_not_marked_calibrated() -> None:
    # the README's GPU tune showed an uncalibrated 0.8 ms prediction as a peer of calibrated
    # ones ("model +2999%"): a candidate whose recipe (precision, compile, float8) no trial
    # ran is predicted with the others' factors, but is not calibrated, and keeps the
    # held-out interval; a measured class gets its own trials' interval
    cands = [c for c in grid() if not c.cpu_offload]
    tried = cands[:3]
    done = [
        TrialResult(candidate=c, status=TrialStatus.OK, step_time=model(c, TRUE).step_time_s,
                    step_time_spread=0.02)
        for c in tried
    ]  # fmt: skip
    eager = [estimate(c) for c in cands[3:6]]
    compiled = [estimate(c.model_copy(update={"compile": True})) for c in cands[3:6]]
    again, calibration = reorder_untried(eager + compiled, done, model, Factors())
    assert calibration.fitted
    for e in again:
        assert e.speed is not None
        assert e.speed.calibrated is (not e.candidate.compile)
        if e.speed.calibrated:
            low, high = e.speed.interval_s or (0, 0)
            assert low <= e.speed.step_time_s <= high
            assert e.speed.interval_class == "calibrated on 3 trials"
        else:
            assert e.speed.interval_class != "calibrated on 3 trials"
