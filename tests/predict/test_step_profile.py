"""The step as memory over time (autoshard/predict/step_profile.py): the memory estimate's
events placed on the speed model's seconds, the peak the estimate's, every micro-batch shown."""

from __future__ import annotations

from typing import Any

import pytest

from autoshard.analyze import analyze_target
from autoshard.config import Candidate, Hardware, Loop, WorkloadSpec
from autoshard.predict.activations import profile_activations
from autoshard.predict.analytic import estimate_memory
from autoshard.predict.calibrate import SpeedModel
from autoshard.predict.step_profile import step_profile
from autoshard.results import MemoryEstimate, StepTimeline
from autoshard.target.resolve import TargetSpec

from ..conftest import EXAMPLES

GIB = 2**30
H100 = Hardware(gpus_per_node=8, gpu_memory=80 * GIB, gpu="h100-sxm")
TWO_NODES = Hardware(gpus_per_node=8, nodes=2, gpu_memory=80 * GIB, gpu="h100-sxm")
GLOO = Hardware(gpus_per_node=2, gpu_memory=8 * GIB, backend="gloo")  # blocking collectives


@pytest.fixture(scope="module")
def gpt() -> Any:
    return analyze_target(TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"}))


def profiled(gpt: Any, candidate: Candidate, hardware: Hardware, workload: WorkloadSpec) -> tuple[
    StepTimeline, MemoryEstimate
]:  # fmt: skip
    """The candidate's timeline and its estimate as the pipeline makes them (speed attached)."""
    profile, built = gpt
    acts = profile_activations(built.model, profile, workload)
    speed = SpeedModel.build(profile, built.model, hardware, workload)
    estimate = speed.attach([estimate_memory(profile, candidate, hardware, workload,
                                             activations=acts)])[0]  # fmt: skip
    return step_profile(speed, estimate, acts), estimate


def blocks(gpt: Any, **kw: Any) -> Candidate:
    wrap = gpt[0].wrap_policy
    if kw.get("checkpointing", "none") != "none":
        kw["checkpoint_classes"] = wrap
    return Candidate(wrap_classes=wrap, **kw)


CASES = {
    "fsdp1 full shard": ({}, H100, {}),
    "fsdp1, 3 micro-batches, syncs skipped": ({}, H100, {"accumulate": 3}),
    "fsdp2 checkpointed, 4 micro-batches": (
        {"engine": "fsdp2", "checkpointing": "all"}, H100, {"accumulate": 4}
    ),
    "selective, Lightning": ({"checkpointing": "selective"}, H100, {"loop": "lightning"}),
    "hybrid on two nodes": ({"sharding": "HYBRID_SHARD", "hybrid_mesh": (2, 8)}, TWO_NODES, {}),
    "one unit": (None, H100, {}),
    "cpu offload": ({"cpu_offload": True}, H100, {}),
    "gloo: nothing overlaps": ({"engine": "fsdp2"}, GLOO, {"accumulate": 2}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_events_run_forward_in_time_and_end_at_the_step_time_less_what_is_off_the_turns(
    gpt: Any, case: str
) -> None:
    kw, hardware, work = CASES[case]
    candidate = Candidate() if kw is None else blocks(gpt, **kw)
    timeline, estimate = profiled(gpt, candidate, hardware, WorkloadSpec(seq_len=128, **work))
    starts = [e.start_s for e in timeline.events]
    assert starts == sorted(starts) and starts[0] >= 0
    assert all(e.end_s >= e.start_s for e in timeline.events)
    for j in range(work.get("accumulate", 1)):  # a micro-batch's backward after its forward
        forward = [e.end_s for e in timeline.events if (e.micro_batch, e.stage) == (j, "forward")]
        backward = [e for e in timeline.events if (e.micro_batch, e.stage) == (j, "backward")]
        assert forward and backward and max(forward) <= min(e.start_s for e in backward)
    # the speed model's own number, not a re-derivation: the optimizer step ends the span; the
    # step time adds FSDP's copies, float8's scale sync, the host-bound floor and pressure
    assert estimate.speed is not None
    assert timeline.step_time_s == estimate.speed.step_time_s
    last = timeline.events[-1]
    assert last.name == "optimizer step" and last.stage == "step"
    b = estimate.speed.breakdown
    assert last.end_s - last.start_s == pytest.approx(b.optimizer_s + b.offload_s, rel=1e-9)
    assert last.end_s + sum(timeline.untimed.values()) == pytest.approx(
        estimate.speed.step_time_s, rel=1e-9
    )
    on_turns = b.compute_s + b.recompute_s + b.exposed_comm_s + b.contention_s
    assert last.start_s == pytest.approx(on_turns, rel=1e-9)


@pytest.mark.parametrize("loop", ["plain", "lightning"])
@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2"])
def test_the_peak_event_is_the_memory_estimates_peak(gpt: Any, loop: str, engine: str) -> None:
    for accumulate in (1, 2, 3):
        workload = WorkloadSpec(seq_len=128, accumulate=accumulate, loop=loop)
        timeline, estimate = profiled(gpt, blocks(gpt, engine=engine), H100, workload)
        peak = timeline.peak_event
        assert peak.live.total == estimate.gpu_peak - estimate.breakdown.allowance
        assert peak.name == estimate.peak_at
        assert max(e.live.total for e in timeline.events) == peak.live.total


def test_every_micro_batch_of_an_accumulated_step_has_its_events_in_turn(gpt: Any) -> None:
    workload = WorkloadSpec(seq_len=128, accumulate=4, loop="plain")
    timeline, _ = profiled(gpt, blocks(gpt), H100, workload)
    steps = [e for e in timeline.events if e.stage != "step"]
    assert sorted({e.micro_batch for e in steps}) == [0, 1, 2, 3]
    for j in range(4):
        mine = [e for e in steps if e.micro_batch == j]
        assert {e.stage for e in mine} == {"forward", "backward"}
        assert any(e.name.endswith("loss") for e in mine)  # each micro-batch's own loss
        # ... and all of it after the micro-batch before
        if j:
            before = max(e.end_s for e in steps if e.micro_batch == j - 1)
            assert min(e.start_s for e in mine) >= before
    # the syncs skipped until the last: only its backward synchronises
    syncing = {e.micro_batch for e in steps if e.name.startswith("synchronising")}
    assert syncing == {3}


def test_lightnings_loop_holds_the_last_steps_gradients_through_the_first_forward(
    gpt: Any,
) -> None:
    by_loop = {}
    for loop in (Loop.PLAIN, Loop.LIGHTNING):
        workload = WorkloadSpec(seq_len=128, accumulate=2, loop=loop)
        by_loop[loop], _ = profiled(gpt, blocks(gpt, engine="fsdp2"), H100, workload)
    lightning = by_loop[Loop.LIGHTNING].events
    held = [e for e in lightning if e.name.endswith("last step's gradients")]
    first_backward = min(e.start_s for e in lightning if e.stage == "backward")
    assert held and all(e.micro_batch == 0 and e.stage == "forward" for e in held)
    assert all(e.end_s <= first_backward and e.live.gradients > 0 for e in held)
    # the plain loop's zero_grad freed them: its first forward runs without gradients
    plain = by_loop[Loop.PLAIN].events
    assert not [e for e in plain if "last step" in e.name]
    first = [e for e in plain if e.micro_batch == 0 and e.stage == "forward"]
    assert first and all(e.live.gradients == 0 for e in first)


def test_the_recommendation_carries_the_chosen_candidates_timeline() -> None:
    import warnings

    import autoshard

    warnings.simplefilter("ignore", autoshard.PlanWarning)
    estimates = autoshard.estimate(f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"},
                                   gpus=8, gpu_memory="24GiB", seq_len=128)  # fmt: skip
    rec = estimates.recommendation
    assert rec is not None and rec.timeline is not None
    chosen = rec.chosen.estimate
    assert chosen is not None and chosen.speed is not None
    assert rec.timeline.candidate == rec.chosen.candidate.label()
    assert rec.timeline.peak_event.name == chosen.peak_at
    assert rec.timeline.step_time_s == chosen.speed.step_time_s
    back = type(rec).model_validate_json(rec.model_dump_json())
    assert back.timeline == rec.timeline


def test_a_decision_from_trials_carries_the_timeline_of_the_candidate_that_won() -> None:
    import warnings

    import autoshard
    from autoshard.api import estimates_for
    from autoshard.decide import decide_from_trials
    from autoshard.options import PlanOptions, options_from
    from autoshard.results import TrialResult, TrialStatus

    warnings.simplefilter("ignore", autoshard.PlanWarning)
    options = options_from(PlanOptions, {"gpus": 8, "gpu_memory": "24GiB", "seq_len": 128})
    plan = estimates_for(f"{EXAMPLES}/gpt.py:build", options, kwargs={"size": "tiny"}).plan
    assert plan is not None
    ran = plan.ranked()[1]  # not the estimate's first choice: the only trial that ran
    trial = TrialResult(candidate=ran.candidate, status=TrialStatus.OK, device="cpu",
                        world_size=2, step_time=0.1, step_time_spread=0.01, samples_per_s=10.0,
                        peak_allocated=(2**20, 2**20))  # fmt: skip
    rec = decide_from_trials(plan, [trial])
    assert rec.chosen.candidate == ran.candidate and rec.timeline is not None
    assert rec.timeline.candidate == ran.candidate.label()
    assert rec.timeline.peak_event.name == ran.peak_at
