"""The fake-tensor set-up the activation profile and the FLOP count share
(:mod:`autoshard.predict.fakes`): both meet every block, nested ones too."""

from __future__ import annotations

import pytest
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


class Tied(nn.Module):
    """Tied weights, a buffer, a submodule met twice and state that is neither (a config)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, WIDTH)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.norm = nn.LayerNorm(WIDTH)
        self.again = self.norm  # one module under two names
        self.head = nn.Linear(WIDTH, 32, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(WIDTH))
        self.config = {"experts": "eager", "sizes": [1, 2]}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) * self.scale
        for layer in self.layers:
            x = layer(x)
        return self.head(self.again(x))


def _state(model: nn.Module) -> list[tuple[object, ...]]:
    """What a copy must leave as it was: each module's own state, each tensor object."""
    state: list[tuple[object, ...]] = []
    for name, module in model.named_modules(remove_duplicate=False):
        hooks = [k for k, v in vars(module).items() if k.endswith("hooks") and v]
        state.append((name, id(module), hooks, "forward" in vars(module)))
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        state.append((name, id(t), type(t), t.device, t.dtype, t.shape))
    return state


@pytest.mark.parametrize("swap", [False, True], ids=["assigned", "swapped"])
def test_the_fake_copy_leaves_the_users_meta_model_as_it_was(swap: bool) -> None:
    """Materialising assigns new parameters into the copy's modules or swaps the copy's
    parameter objects in place (``torch.__future__``'s swap on conversion): neither reaches the
    model the copy was made of."""
    was = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        _copy_and_materialise_leaves_the_model()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(was)


def _copy_and_materialise_leaves_the_model() -> None:
    with torch.device("meta"):
        model = Tied()
    before, config = _state(model), repr(model.config)
    layer = f"{__name__}.Layer"
    fakes = fake_model(model, (layer,), torch.zeros(1, TOKENS, dtype=torch.long), torch.bfloat16)
    copy = fakes.model
    assert fakes.repeats == {id(copy.layers[1])}
    with fakes.mode:  # what the profiles do to the copy: hooks, forwards, every repeat made
        copy.layers[0].register_forward_hook(lambda *_: None)
        copy.layers[1].forward = copy.layers[1].forward
        assert fakes.materialize(copy.layers[1])
    copy.config["experts"] = "grouped_mm"
    copy.config["sizes"].append(3)
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in copy.parameters())
    assert _state(model) == before and repr(model.config) == config


class CopiesItself(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.copies = 0

    def __deepcopy__(self, memo: dict[int, object]) -> CopiesItself:
        new = CopiesItself().to("meta")
        new.copies = self.copies + 1
        return new


def test_the_copy_is_deepcopys_ties_shared_modules_and_own_copies_kept() -> None:
    from autoshard.predict.fakes import module_copy

    with torch.device("meta"):
        model = nn.Sequential(Tied(), CopiesItself())
    copied = module_copy(model)
    tied = copied[0]
    assert tied.head.weight is tied.emb.weight and tied.again is tied.norm
    assert isinstance(copied[1], CopiesItself) and copied[1].copies == 1  # its own way
    assert tied.config == model[0].config and tied.config["sizes"] is not model[0].config["sizes"]
    ids = {id(o) for o in [*model.modules(), *model.parameters(), *model.buffers()]}
    assert not ids & {id(o) for o in [*copied.modules(), *copied.parameters(), *copied.buffers()]}
