"""Measurements that mean something: the median's spread, when to stop timing, the tie rule, and
the recommendation and its reasons built on them."""

from __future__ import annotations

import re

import numpy as np
import pytest

from autoshard.config import Candidate, Hardware, Sharding, WorkloadSpec
from autoshard.decide import choose_from_trials as recommend_from_trials
from autoshard.measure import (
    compare,
    enough_steps,
    is_tie,
    median_interval,
    median_spread,
    speed_basis,
)
from autoshard.results import MemoryEstimate, SpeedEstimate, TrialResult, TrialStatus
from tests.test_emit import PROFILE, estimate

GIB = 1024**3


def run(
    step: float,
    *,
    spread: float | None = 0.02,
    peak: int = 100 * 2**20,
    mbs: int = 2,
    device: str = "cpu",
    **update: object,
) -> TrialResult:
    candidate = Candidate.model_validate(
        {"wrap_classes": ("gpt.Block",), "micro_batch_size": mbs, **update}
    )
    return TrialResult(
        candidate=candidate,
        status=TrialStatus.OK,
        device=device,
        world_size=2,
        step_time=step,
        step_time_spread=spread,
        samples_per_s=2 * mbs / step,
        tokens_per_s=2 * mbs * 128 / step,
        peak_allocated=(peak, peak),
    )


# ---------------------------------------------------------------------------------------------
# The spread of the median and the stopping rule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [6, 9, 15, 40])
def test_median_interval_covers_the_true_median_95_percent_of_the_time(n: int) -> None:
    """On skewed noise (log-normal step times, a long tail like GC pauses), the order-statistic
    interval holds the true median in at least 95% of 4,000 repetitions, and not far above
    (an interval that is too wide would make everything a tie)."""
    rng = np.random.default_rng(n)
    true_median = 0.2  # exp(mu) of the log-normal
    samples = true_median * np.exp(rng.normal(0.0, 0.3, size=(4000, n)))
    hits = 0
    for row in samples:
        lo, hi = median_interval(row.tolist())
        hits += lo <= true_median <= hi
    coverage = hits / len(samples)
    assert 0.95 <= coverage <= 0.995, coverage


def test_spread_shrinks_as_more_steps_are_timed() -> None:
    rng = np.random.default_rng(0)
    times = (0.1 * np.exp(rng.normal(0, 0.1, 400))).tolist()
    spreads = [median_spread(times[:n]) for n in (10, 40, 160, 400)]
    assert spreads == sorted(spreads, reverse=True)
    assert spreads[-1] < spreads[0] / 3  # roughly 1/sqrt(n)


def test_timing_stops_on_spread_or_budget_never_before_the_minimum() -> None:
    steady = [0.1] * 20
    assert not enough_steps(steady[:5], min_steps=3)  # 95% needs 6 order statistics
    assert enough_steps(steady[:6], min_steps=3)
    assert not enough_steps(steady[:6], min_steps=10)  # --steps is the minimum
    assert enough_steps(steady[:10], min_steps=10)
    noisy = [0.1, 0.15, 0.2, 0.12] * 20
    assert not enough_steps(noisy[:30], min_steps=3)
    assert enough_steps(noisy[:40], min_steps=3)  # the step budget
    assert enough_steps(noisy[:8], min_steps=3, max_seconds=1.0)  # the time budget
    assert not enough_steps(noisy[:8], min_steps=3, max_seconds=2.0)
    assert enough_steps(noisy[:8], min_steps=3, target_spread=0.5)


# ---------------------------------------------------------------------------------------------
# The tie rule
# ---------------------------------------------------------------------------------------------


def test_difference_within_the_spreads_is_a_tie() -> None:
    slim = run(0.104, spread=0.03, peak=80 * 2**20)  # 4% slower, less memory
    quick = run(0.100, spread=0.03, peak=120 * 2**20)
    outcome = compare(quick, slim)
    assert outcome.tie and is_tie(slim, quick)
    # the comparison orders by throughput; what the tie decides is decide.ranked's
    assert outcome.winner is quick and compare(slim, quick).winner is quick
    assert outcome.describe() == "tie within noise (±6%)"


def test_difference_beyond_the_spreads_is_a_win() -> None:
    slim = run(0.104, spread=0.01, peak=80 * 2**20)
    quick = run(0.100, spread=0.01, peak=120 * 2**20)
    outcome = compare(slim, quick)
    assert not outcome.tie and outcome.winner is quick and compare(quick, slim).winner is quick
    assert outcome.describe() == "1.04x faster"


def test_throughput_not_step_time_is_compared() -> None:
    # Twice the micro-batch in 1.5x the time: faster per sample, though each step is slower.
    small, big = run(0.100, mbs=2), run(0.150, mbs=4)
    assert compare(small, big).winner is big and not is_tie(small, big)


def test_a_record_without_a_spread_uses_its_step_times() -> None:
    noisy = run(0.100, spread=None).model_copy(
        update={"step_times": (0.08, 0.1, 0.12, 0.1, 0.09, 0.11)}
    )
    other = run(0.105, spread=0.0)
    assert is_tie(noisy, other)  # ±20% from the step times
    assert not is_tie(noisy.model_copy(update={"step_times": ()}), other)


def test_the_recommendation_ranks_ties_against_the_fastest_and_the_rest_by_throughput() -> None:
    a = run(0.100, spread=0.02, peak=300)  # the fastest
    b = run(0.102, spread=0.02, peak=100)  # tied with a, least memory
    c = run(0.103, spread=0.02, peak=200)  # tied with a
    d = run(0.200, spread=0.02, peak=50)  # clearly slower
    failed = TrialResult(candidate=Candidate(), status=TrialStatus.OOM)
    rec = recommend([d, a, failed, c, b])
    assert [s.trial for s in (rec.chosen, *rec.runners_up)] == [a, b, c, d]
    # a near the limit: it yields to the fastest tied one that is not
    edge = a.model_copy(update={"peak_allocated": (int(0.99 * HARDWARE.usable_gpu_memory),)})
    rec = recommend([d, edge, failed, c, b])
    assert [s.trial for s in (rec.chosen, *rec.runners_up)] == [b, c, edge, d]


# ---------------------------------------------------------------------------------------------
# What the recommendation says
# ---------------------------------------------------------------------------------------------

HARDWARE = Hardware(gpus_per_node=2, gpu_memory=2 * GIB, backend="gloo")
WORKLOAD = WorkloadSpec(micro_batch_size=2, seq_len=128)


def recommend(trials: list[TrialResult], hardware: Hardware = HARDWARE, estimates=()):
    ests = list(estimates) or [estimate(t.candidate) for t in trials]
    return recommend_from_trials(PROFILE, hardware, WORKLOAD, ests, trials)


def test_recommendation_never_announces_a_win_inside_noise() -> None:
    quick = run(0.100, spread=0.04, peak=150 * 2**20)
    slim = run(0.104, spread=0.04, peak=90 * 2**20, sharding=Sharding.SHARD_GRAD_OP)
    rec = recommend([quick, slim])
    # as fast as far as can be told, and the faster one's headroom is enough: no speed is
    # traded for more headroom
    assert rec.chosen.trial is quick
    text = "\n".join(rec.reasons)
    assert "one other within the noise (±8%), not preferred for headroom" in text, text
    assert not re.search(r"\d\.\d\dx", text), text  # no ratio at all inside noise
    assert "sharding=SHARD_GRAD_OP: tie within noise" in text
    # the faster one near the limit (under 5% of the usable memory to spare): the tied one wins,
    # and the reason names the risk, not "headroom"
    edge = quick.model_copy(update={"peak_allocated": (int(0.96 * HARDWARE.usable_gpu_memory),)})
    rec = recommend([edge, slim])
    assert rec.chosen.trial is slim
    assert rec.reasons[0].startswith(
        "within the noise (±8%) of the fastest measured, fsdp1 FULL_SHARD bf16-mixed mbs2, "
        "which is near the memory limit ("
    ), rec.reasons[0]


def test_recommendation_names_a_real_win() -> None:
    quick = run(0.100, spread=0.01, peak=150 * 2**20)
    slow = run(0.130, spread=0.01, peak=90 * 2**20, sharding=Sharding.SHARD_GRAD_OP)
    rec = recommend([slow, quick])
    assert rec.chosen.trial is quick
    assert rec.reasons[0].startswith("fastest of 2 measured configurations: 0.100 s/step (±1%)")
    assert "sharding=SHARD_GRAD_OP measured 1.30x slower" in rec.reasons


def test_every_trial_is_in_the_recommendation() -> None:
    """Six OK trials and an OOM: all seven are listed (runners-up were cut at four)."""
    oks = [run(0.1 + 0.02 * i, spread=0.01, mbs=i + 1) for i in range(6)]
    oom = TrialResult(candidate=Candidate(micro_batch_size=64), status=TrialStatus.OOM)
    rec = recommend([*oks, oom])
    listed = [s.trial for s in (rec.chosen, *rec.runners_up, *rec.ruled_out)]
    assert len(listed) == 7 and all(t in listed for t in [*oks, oom])


def with_speed(e: MemoryEstimate, samples_per_s: float) -> MemoryEstimate:
    speed = SpeedEstimate(
        step_time_s=4 / samples_per_s, samples_per_s=samples_per_s, gpu="h100-sxm"
    )
    return e.model_copy(update={"speed": speed})


def test_cpu_trials_for_gpus_check_and_the_model_ranks() -> None:
    """Planning for GPUs with CPU trials: the measured CPU order is ignored, the predicted one
    decides among the configurations that ran, and the reasons say so in one line."""
    gpus = Hardware(gpus_per_node=8, gpu_memory=80 * GIB, gpu="h100-sxm")
    cpu_fast = run(0.050, spread=0.01)  # fastest on the CPU
    gpu_fast = run(0.200, spread=0.01, sharding=Sharding.SHARD_GRAD_OP)  # fastest predicted
    estimates = [with_speed(estimate(cpu_fast.candidate), 900.0)]
    estimates.append(with_speed(estimate(gpu_fast.candidate), 1200.0))
    assert speed_basis(gpus, [cpu_fast, gpu_fast]) == "model"
    rec = recommend([cpu_fast, gpu_fast], gpus, estimates)
    assert rec.chosen.trial is gpu_fast
    assert rec.reasons[0] == (
        "trials ran on CPU processes: they checked that configurations build, train and fit; "
        "the speed order is the model's for 8 x h100-sxm"
    )
    assert "sharding=FULL_SHARD predicted 1.33x slower" in rec.reasons
    # The same trials planning for CPU processes: the measurement decides.
    assert speed_basis(HARDWARE, [cpu_fast, gpu_fast]) == "trials"
    assert recommend([cpu_fast, gpu_fast], HARDWARE, estimates).chosen.trial is cpu_fast


def test_cpu_trials_for_gpus_call_a_predicted_tie_a_tie() -> None:
    """Two configurations predicted within the model's tie: the faster prediction is chosen
    while its predicted headroom on the planned GPUs is enough (not the smaller CPU peak: CPU
    processes measure neither a GPU's memory nor, between equal configurations, more than
    noise), and the reasons say it was a tie that headroom did not decide."""
    gpus = Hardware(gpus_per_node=8, gpu_memory=80 * GIB, gpu="h100-sxm")
    quick = run(0.100, spread=0.01, peak=90 * 2**20)
    slim = run(0.100, spread=0.01, peak=150 * 2**20, sharding=Sharding.SHARD_GRAD_OP)
    estimates = [with_speed(estimate(quick.candidate), 1020.0)]
    estimates.append(with_speed(estimate(slim.candidate, scale=0.5), 1000.0))
    rec = recommend([quick, slim], gpus, estimates)
    assert rec.chosen.trial is quick
    assert rec.reasons[1].startswith("fastest of 2 predicted configurations: "), rec.reasons[1]
    assert (
        "one other within the noise (±5%), not preferred for headroom: its headroom ("
        in (rec.reasons[1])
    )
    assert "sharding=SHARD_GRAD_OP predicted about as fast (within 5%)" in rec.reasons
    # the same estimates without trials choose the same configuration: one answer
    from autoshard.space import rank_candidates

    assert rank_candidates(estimates)[0].candidate == quick.candidate
    # the faster prediction near the limit: the tie goes to the one that is not, here and there
    edge = estimates[0].model_copy(update={"headroom": estimates[0].gpu_peak // 50})
    rec = recommend([quick, slim], gpus, [edge, estimates[1]])
    assert rec.chosen.trial is slim
    assert rec.reasons[1].startswith("within the noise (±5%) of the fastest predicted"), rec.reasons
    assert (
        "sharding=FULL_SHARD predicted about as fast (within 5%), but near the memory limit ("
        in ("\n".join(rec.reasons))
    )
    assert rank_candidates([edge, estimates[1]])[0].candidate == slim.candidate
    # 1.25x apart: no tie, and the fastest predicted is named as such
    estimates[1] = with_speed(estimate(slim.candidate), 1275.0)
    rec = recommend([quick, slim], gpus, estimates)
    assert rec.chosen.trial is slim
    assert rec.reasons[1] == "fastest of 2 predicted configurations: " + (
        f"{4 / 1275.0:.3f} s/step"
    ), rec.reasons[1]


def test_the_module_examples_run() -> None:
    import doctest

    import autoshard.measure

    result = doctest.testmod(autoshard.measure, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0


def test_each_trial_is_reported_against_the_prediction_it_was_tried_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The study re-predicts untried candidates after each trial (calibrated): the
    recommendation carries those predictions, not the plan's first ones."""
    from types import SimpleNamespace

    from autoshard import decide
    from autoshard.decide import decide_from_trials

    # a plan of estimates alone (no speed model, no activations): no timeline to draw
    monkeypatch.setattr(decide, "timeline_of", lambda plan, chosen, factors=None: None)

    first, second = run(0.100, spread=0.01), run(0.130, sharding=Sharding.SHARD_GRAD_OP)
    plan_estimates = [with_speed(estimate(t.candidate), 100.0) for t in (first, second)]
    calibrated = with_speed(estimate(second.candidate), 31.0)
    calibrated = calibrated.model_copy(
        update={"speed": calibrated.speed.model_copy(update={"calibrated": True})}
    )
    plan = SimpleNamespace(profile=PROFILE, hardware=HARDWARE, workload=WORKLOAD,
                           estimates=plan_estimates, notes=())  # fmt: skip
    rec = decide_from_trials(plan, [first, second], {second.candidate.label(): calibrated})
    by_trial = {s.trial.candidate.label(): s.estimate for s in (rec.chosen, *rec.runners_up)}
    assert by_trial[second.candidate.label()] == calibrated
    assert by_trial[first.candidate.label()] == plan_estimates[0]


# ---------------------------------------------------------------------------------------------
# Edges of the measurement rules (found by mutation testing, scripts/mutation.sh measure)
# ---------------------------------------------------------------------------------------------


def test_the_median_interval_of_one_step_and_of_none() -> None:
    assert median_interval([0.3]) == (0.3, 0.3)
    assert median_interval([0.3, 0.1]) == (0.1, 0.3)
    with pytest.raises(ValueError, match=r"^no step times$"):
        median_interval([])
    # a median of zero (a step too fast for the clock) has no relative spread, not a division
    assert median_spread([0.0, 0.0, 0.0]) == 0.0


def test_timing_stops_exactly_at_its_limits() -> None:
    # one step asked for and allowed (the warm-up's throwaway trial): one step is enough
    assert enough_steps([0.1], min_steps=1, max_steps=1)
    # the time budget reached exactly, long before any spread is known
    assert enough_steps([0.5, 0.5], min_steps=2, max_seconds=1.0)
    assert not enough_steps([0.5, 0.4], min_steps=2, max_seconds=1.0)
    # a spread exactly at the target is within it
    assert enough_steps([0.1] * 6, min_steps=3, target_spread=0.0)


def test_equal_throughputs_tie_and_the_first_keeps_it_at_equal_headroom() -> None:
    a, b = run(0.100, spread=0.0, peak=100), run(0.100, spread=0.0, peak=100)
    outcome = compare(a, b)
    assert outcome.tie and outcome.winner is a and outcome.loser is b
    assert outcome.ratio == 1.0 and outcome.noise == 0.0
    assert compare(b, a).winner is b
    # the loser is the other trial, also when there is a clear winner
    slow = run(0.200, spread=0.0)
    assert compare(slow, a).loser is slow and compare(a, slow).loser is slow


def test_a_trial_without_a_measured_peak_loses_a_tie() -> None:
    measured = run(0.101, spread=0.05)
    unmeasured = run(0.100, spread=0.05).model_copy(update={"peak_allocated": ()})
    assert recommend([unmeasured, measured]).chosen.trial is measured
    assert recommend([measured, unmeasured]).chosen.trial is measured


def test_slow_rates_and_trials_without_rates() -> None:
    from autoshard.measure import throughput, trials_checked_line

    def rated(samples_per_s: float | None, status: TrialStatus = TrialStatus.OK) -> TrialResult:
        return TrialResult(
            candidate=Candidate(), status=status, samples_per_s=samples_per_s, step_time=1.0
        )

    slow, slower, none = rated(0.5), rated(0.25), rated(None)
    assert throughput(none) == 0.0 and throughput(slow) == 0.5
    assert compare(slow, slower).ratio == pytest.approx(2.0)  # rates below 1 sample/s
    assert compare(slow, none).ratio == float("inf")
    oom = rated(3.0, TrialStatus.OOM)
    rec = recommend([none, slower, oom, slow])
    assert [s.trial for s in (rec.chosen, *rec.runners_up)] == [slow, slower]
    # the planned GPU is named when known
    hw = Hardware(gpus_per_node=8, gpu_memory=80 * GIB)
    assert trials_checked_line(hw).endswith("the model's for 8 x the planned GPU")
    named = hw.model_copy(update={"gpu": "h100-sxm"})
    assert trials_checked_line(named).endswith("the model's for 8 x h100-sxm")
    assert trials_checked_line(named, "a100-80gb").endswith("8 x a100-80gb")


def test_hybrid_shard_differs_from_full_shard_only_in_sharding_and_no_trial_ran_is_one_line() -> (
    None
):
    from autoshard.decide import nothing_ran
    from autoshard.reasons import _differs_only_in

    hybrid = Candidate(sharding=Sharding.HYBRID_SHARD, hybrid_mesh=(2, 4))
    assert _differs_only_in(hybrid, Candidate(), "sharding")  # its mesh comes with it
    assert not _differs_only_in(hybrid, Candidate(micro_batch_size=2), "sharding")
    oom = TrialResult(
        candidate=Candidate(), status=TrialStatus.OOM, error="OutOfMemoryError: 2 GiB"
    )
    other = oom.model_copy(update={"error": "OutOfMemoryError: 3 GiB"})
    pruned = TrialResult(candidate=Candidate(), status=TrialStatus.PRUNED, error="too big")
    assert nothing_ran([oom, other, pruned]) == (
        "no configuration ran successfully: 2 trials failed (2 x oom: OutOfMemoryError: 3 GiB)"
        ", 1 more candidates ruled out; each ran out of memory: plan more GPUs or smaller "
        "micro-batches (the workers' logs are in the output folder, under workers/)"
    )
    assert nothing_ran([pruned]) == (
        "no configuration could run: all 1 candidates were ruled out (too big)"
    )
