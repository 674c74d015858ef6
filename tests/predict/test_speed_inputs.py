"""SpeedInputs (autoshard.predict.speed_inputs): what the step-time model reads besides the
candidate, one object; predict_speed's keyword options reach it unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from autoshard.analyze import analyze_model
from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.gpus import CATALOGUE
from autoshard.predict.flops import profile_flops
from autoshard.predict.speed import predict_speed, speed_of, turn_seconds
from autoshard.predict.speed_inputs import SpeedInputs

D = 32
TWO = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30)
# fp32 products twice as fast on tensor cores: tf32 moves the compute
GPU = CATALOGUE["h100-sxm"].model_copy(update={"tf32_flops": 2 * CATALOGUE["h100-sxm"].fp32_flops})


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.fixture(scope="module")
def inputs() -> SpeedInputs:
    with torch.device("meta"):
        model = Net()
    profile = analyze_model(model)
    workload = WorkloadSpec(accumulate=2)
    flops = profile_flops(model, profile, workload, batch=torch.randn(2, D))
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
