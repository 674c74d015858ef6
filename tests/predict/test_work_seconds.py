"""Each analysed block's share of what the FLOP profile counted per block: one rule
(``work_seconds.per_analysed_block``, autoshard/predict/work_seconds.py) gives a block its
seconds (``piece_seconds``) and the kernels its host issues (``host_bound``), whether or not the
profile ran the analysed blocks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from autoshard.analyze import analyze_model
from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.predict.flops import profile_flops
from autoshard.predict.host_bound import HostStep, _Kernels, host_seconds
from autoshard.predict.timeline import Pass, step_timeline
from autoshard.predict.work_seconds import WorkRates, piece_seconds

D = 32


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Small(nn.Module):
    """Half of Big's parameters (a unit of its own) and more kernels than Big."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(torch.sigmoid(torch.relu(self.up(x)))))


class TwoClasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(D, D), nn.Linear(D, D)
        self.big = nn.ModuleList(Big() for _ in range(3))
        self.small = nn.ModuleList(Small() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in (*self.big, *self.small):
            x = block(x)
        return self.head(x)


@pytest.fixture(scope="module")
def two_classes():
    with torch.device("meta"):
        model = TwoClasses()
    profile = analyze_model(model)
    assert profile.block_count == 5 and len(profile.wrap_policy) == 2
    flops = profile_flops(model, profile, WorkloadSpec(), batch=torch.randn(2, D))
    assert flops.measured and len(set(flops.block_forward_ops)) == 2  # Big's and Small's
    return profile, flops


# A piece's seconds are its kernel count: every kernel costs 1 s, FLOPs and bytes nothing.
ONE_SECOND_A_KERNEL = WorkRates(math.inf, math.inf, math.inf, op_s=1.0, host_is_device=False)


# the depth as profiled, deeper and shallower than profiled (a depth not analysed whole), none
@pytest.mark.parametrize("depth", [5, 8, 3, 0])
@pytest.mark.parametrize("selective", [False, True], ids=["forward", "selective"])
def test_a_blocks_seconds_and_its_kernels_are_shared_out_by_one_rule(
    two_classes, depth: int, selective: bool
) -> None:
    profile, flops = two_classes
    fwd, bwd, rec, _, _ = piece_seconds(depth, flops, ONE_SECOND_A_KERNEL, selective)
    analysed = profile.model_copy(update={"block_count": depth})
    kernels = _Kernels(analysed, flops, selective=selective).per_block
    assert (kernels[Pass.FORWARD], kernels[Pass.BACKWARD], kernels[Pass.RECOMPUTE]) == (
        fwd, bwd, rec,
    )  # fmt: skip
    # the rule: the profile's own blocks at its depth, else their total spread evenly, all kept
    profiled = flops.block_forward_ops
    assert len(fwd) == max(depth, 1)
    assert sum(fwd) == pytest.approx(sum(profiled))
    if depth == len(profiled):
        assert fwd == profiled
    else:
        assert set(fwd) == {sum(profiled) / max(depth, 1)}
    rerun = flops.selective_recompute()
    assert rerun is not None
    assert sum(rec) == pytest.approx(sum((rerun if selective else flops).block_forward_ops))


@pytest.mark.parametrize("depth", [5, 8, 3])
def test_the_host_issues_every_profiled_kernel_whatever_the_analysed_depth(
    two_classes, depth: int
) -> None:
    profile, flops = two_classes
    one = Hardware(gpus_per_node=1, gpu_memory=80 * 2**30)
    # fp32 (no autocast), FSDP's hooks at nothing: the kernels only
    candidate = Candidate(wrap_classes=profile.wrap_policy, precision="32-true")
    step = step_timeline(
        candidate, one, WorkloadSpec(), blocks=depth, params=float(profile.total_params),
        block_params=float(profile.block_params),
    )  # fmt: skip
    analysed = profile.model_copy(update={"block_count": depth})
    kernels = sum(flops.block_forward_ops) + sum(flops.block_backward_ops)
    kernels += flops.other_forward_ops + flops.other_backward_ops
    host = host_seconds(HostStep(step, analysed, flops, candidate, one), op_s=1.0, unit_scale=0.0)
    assert host == pytest.approx(kernels)
