"""SpeedInputs (autoshard.predict.speed_inputs): what the step-time model reads besides the
candidate, one object; predict_speed's keyword options reach it unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.gpus import CATALOGUE
from autoshard.predict.speed import predict_speed, speed_of, turn_seconds
from autoshard.predict.speed_inputs import SpeedInputs
from tests.predict.linear_chain import Chain, profiled

D = 32
TWO = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30)
# fp32 products twice as fast on tensor cores: tf32 moves the compute
GPU = CATALOGUE["h100-sxm"].model_copy(update={"tf32_flops": 2 * CATALOGUE["h100-sxm"].fp32_flops})


@pytest.fixture(scope="module")
def inputs() -> SpeedInputs:
    workload = WorkloadSpec(accumulate=2)
    with torch.device("meta"):
        profile, flops = profiled(Chain(D, 3, inp=False), workload)
    return SpeedInputs(profile, flops, TWO, workload, gpu=GPU)


def test_predict_speed_hands_every_option_to_the_inputs(inputs: SpeedInputs) -> None:
    fp32 = Candidate(wrap_classes=["Block"], precision="32-true")
    args = (inputs.profile, inputs.flops, fp32, inputs.hardware, inputs.workload)
    # each option moves the step (so that dropping one on the way would show) ...
    moved = {
        "tf32": dataclasses.replace(inputs, tf32=True),
        "skip_sync": dataclasses.replace(inputs, skip_sync=False),
        "gpu": dataclasses.replace(inputs, gpu=CATALOGUE["a100-80gb-sxm"]),
    }
    plain = speed_of(inputs, fp32)
    for name, changed in moved.items():
        speed = speed_of(changed, fp32)
        assert speed != plain, name
        # ... and predict_speed's keyword reaches it: the same prediction
        given = {"gpu": GPU, name: getattr(changed, name)}
        assert predict_speed(*args, **given) == speed, name  # type: ignore[arg-type]
    assert predict_speed(*args, gpu=GPU) == plain


def test_turn_seconds_time_the_step_speed_of_predicts(inputs: SpeedInputs) -> None:
    candidate = Candidate(wrap_classes=["Block"])
    turns = turn_seconds(inputs, candidate)
    assert sum(mb.count for mb, _, _ in turns) == inputs.workload.accumulate
    breakdown = speed_of(inputs, candidate).breakdown
    elapsed = sum(mb.count * (f.elapsed + b.elapsed) for mb, f, b in turns)
    timed = breakdown.compute_s + breakdown.recompute_s + breakdown.exposed_comm_s
    assert elapsed == pytest.approx(timed + breakdown.contention_s, rel=1e-9)
    assert breakdown.exposed_comm_s > 0  # two ranks: the collectives are in the turns


def test_the_inputs_are_frozen(inputs: SpeedInputs) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.tf32 = True  # type: ignore[misc]
