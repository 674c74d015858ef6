"""The fake-tensor set-up the activation profile and the FLOP count share
(:mod:`autoshard.predict.fakes`): both meet every block, nested ones too."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from autoshard import WorkloadSpec, analyze_model, profile_activations
from autoshard.predict.fakes import fake_model
from autoshard.predict.flops import profile_flops

WIDTH, TOKENS = 16, 8


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x))


class Stage(nn.Module):
    """A block holding blocks (a Swin stage, a wrap policy naming a stack and its layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _staged(device: str) -> nn.Module:
    with torch.device(device):
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), Stage(), Stage(), Stage())


def _profile(model: nn.Module):
    prefix = f"{__name__}."
    return analyze_model(model).model_copy(
        update={"checkpoint_policy": (prefix + "Stage", prefix + "Layer")}
    )


def test_repeated_stages_stay_on_meta_but_run_for_their_inner_blocks() -> None:
    model = _staged("meta")
    fakes = fake_model(model, _profile(model).checkpoint_policy, torch.randn(1, TOKENS, WIDTH))
    stages = [b for b in fakes.blocks if isinstance(b, Stage)]
    layers = [b for b in fakes.blocks if isinstance(b, Layer)]
    assert len(stages) == 3 and len(layers) == 6
    assert fakes.nested == {id(s) for s in stages}  # holding blocks: never skipped
    assert fakes.repeats == {id(layer) for layer in layers[1:]}  # the first layer runs
    assert all(not p.is_meta for p in stages[2].proj.parameters())
    assert all(p.is_meta for p in layers[5].parameters())


def test_nested_blocks_are_counted_as_the_whole_model_counts_them() -> None:
    """The FLOP count meets every inner block (it fell back to 6 x parameters x tokens when a
    repeated stage was skipped) and counts each operation once, in the innermost block."""
    model = _staged("meta")
    batch = torch.randn(2, TOKENS, WIDTH)
    flops = profile_flops(model, _profile(model), WorkloadSpec(), batch=batch)
    assert flops.measured, flops.note
    linear = 2 * TOKENS * WIDTH * WIDTH  # one Linear's forward, one sample
    # module order: stage, its two layers, next stage...
    assert flops.block_forward == (linear, linear, linear) * 3
    assert flops.other_forward == linear  # the first Linear
    real = _staged("cpu")
    with FlopCounterMode(display=False) as counter:
        real(batch[:1]).sum().backward()
    assert flops.total == counter.get_total_flops()
    assert sum(flops.block_backward) + flops.other_backward == flops.backward


def test_nested_blocks_saved_bytes_counted_once_in_the_innermost_block() -> None:
    model = _staged("meta")
    acts = profile_activations(
        model, _profile(model), WorkloadSpec(), batch=torch.randn(2, TOKENS, WIDTH)
    )
    assert acts.measured, acts.note
    sample = TOKENS * WIDTH * 4  # one fp32 activation of one sample
    # a stage saves its projection's input; a layer its Linear's input and GELU's input
    assert acts.block_bytes == (sample, 2 * sample, 2 * sample) * 3
    assert acts.other_bytes == sample  # the first Linear's input: one sample of the batch
    assert len(acts.block_input_bytes) == 9
