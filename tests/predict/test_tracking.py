"""torch's memory trackers around a training step (autoshard.predict.tracking) when they book
more than one device, as on a GPU: the optimizers' step counters stay on the CPU while the model
trains on CUDA. ``benchmarks/estimate_accuracy.py --device cuda`` failed at 116 of 117 points
("too many values to unpack (expected 1)"): every Adam point. Here the second device is the
meta device, which a CPU test can allocate on: an optimizer keeps a meta tensor in its state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autoshard.config import Candidate, Engine
from autoshard.predict.tracking import device_snapshot, track_training_peak, training_device

SHADOW = 1 << 20  # elements of the meta tensor: 4 MiB, far above the CPU peak


class ShadowAdamW(torch.optim.AdamW):
    """AdamW that also keeps a tensor on another device in its state (as Adam keeps its step
    counters on the CPU beside a model on a GPU)."""

    def __init__(self, *args: Any, shadow: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shadow = shadow

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        if self.shadow:
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p].setdefault("shadow", torch.empty(SHADOW, device="meta"))
        return out


def _peak(engine: Engine, *, shadow: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = ShadowAdamW(model.parameters(), shadow=shadow)
    batch = torch.randn(16, 64)
    return track_training_peak(
        model, optimizer, batch, Candidate(engine=engine, precision="32-true"),
        loss_fn=lambda out, _: out.square().mean(),
    )  # fmt: skip


def test_a_peak_is_the_training_devices_when_the_tracker_books_another_device() -> None:
    alone = _peak(Engine.FSDP1, shadow=False)
    beside = _peak(Engine.FSDP1, shadow=True)
    assert alone["Total"] > 0
    # the CPU's peak, as if the other device's bytes were not there (they are 16 MiB: a sum
    # or the other device's snapshot would be far larger)
    assert beside == alone


def test_the_snapshot_is_chosen_by_device_type_and_index() -> None:
    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    snaps = {cuda0: {"Total": 10}, cpu: {"Total": 3}}
    assert device_snapshot(snaps, torch.device("cuda")) == {"Total": 10}
    assert device_snapshot(snaps, cuda0) == {"Total": 10}
    assert device_snapshot(snaps, cpu) == {"Total": 3}
    with pytest.raises(RuntimeError, match="no single snapshot of cuda:1"):
        device_snapshot(snaps, cuda1)
    with pytest.raises(RuntimeError, match="devices: cuda:0, cuda:1"):
        device_snapshot({cuda0: {}, cuda1: {}}, torch.device("cuda"))


def test_the_training_device_is_the_batchs() -> None:
    model = nn.Linear(2, 2).to("meta")
    assert training_device(model, {"x": [torch.zeros(1)]}) == torch.device("cpu")
    assert training_device(model, None) == torch.device("meta")
