"""The analyzer on the examples, tied weights, models with no repeated blocks, HF-style hints."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from autoshard.analyze import SMALL_UNIT_PARAMS, analyze_model, analyze_target
from autoshard.results import ModelProfile
from autoshard.target.resolve import TargetSpec

from .conftest import EXAMPLES

GPT = f"{EXAMPLES}/gpt.py:build"


def gpt_params(n_layer: int, d: int, vocab: int, seq: int) -> tuple[int, int, int]:
    """Hand count of examples/gpt.py's GELU variant: (total, per block, outside blocks)."""
    attn = d * d + d * 2 * d + d * d  # q, kv, o projections, no bias
    mlp = d * 4 * d + 4 * d + 4 * d * d + d  # up + bias, down + bias
    norms = 2 * 2 * d
    block = attn + mlp + norms
    outside = vocab * d + seq * d + 2 * d + d * vocab  # tok_emb, pos_emb, final norm, lm_head
    return n_layer * block + outside, block, outside


def test_gpt_tiny_counts_and_blocks() -> None:
    profile, _ = analyze_target(TargetSpec(spec=GPT, kwargs={"size": "tiny"}))
    total, block, outside = gpt_params(4, 128, 4096, 256)
    assert profile.total_params == total
    assert profile.block_classes == ("gpt.Block",)
    assert profile.block_count == 4 and profile.block_params == block
    assert profile.wrap_policy == profile.checkpoint_policy == ("gpt.Block",)
    assert profile.root_unit_params == outside
    assert profile.vocab_size == 4096 and profile.hidden_size == 128
    assert profile.built_on == "meta"
    # The root keeps more than a block (embedding + head): reported with its size.
    assert any(f"root unit keeps {outside:,}" in w for w in profile.warnings)
    stats = {c.name: c for c in profile.classes}
    assert stats["Block"].count == 4 and stats["Block"].params_total == 4 * block
    assert stats["Linear"].count == 4 * 5 + 1  # q, kv, o, up, down per block + lm_head


def test_per_module_counts_add_up() -> None:
    profile, _ = analyze_target(TargetSpec(spec=GPT, kwargs={"size": "tiny"}))
    rows = {m.name: m for m in profile.modules}
    assert rows[""].params == profile.total_params
    top = [m for m in profile.modules if m.depth == 1]
    assert sum(m.params for m in top) + rows[""].own_params == profile.total_params


def test_tied_weights_counted_once_and_reported() -> None:
    untied, _ = analyze_target(TargetSpec(spec=GPT, kwargs={"size": "tiny"}))
    tied, _ = analyze_target(TargetSpec(spec=GPT, kwargs={"size": "tiny", "tie_embeddings": True}))
    assert untied.total_params - tied.total_params == 4096 * 128
    assert len(tied.tied) == 1
    assert set(tied.tied[0].names) == {"tok_emb.weight", "lm_head.weight"}
    assert tied.tied[0].numel == 4096 * 128
    assert any("tied parameters" in w for w in tied.warnings)


def test_small_model_without_repeated_blocks_is_one_unit() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    profile = analyze_model(model)
    assert profile.block_classes == ()
    assert profile.wrap_policy == () and profile.wrap_min_params is None
    assert profile.root_unit_params == profile.total_params == 16 * 32 + 32 + 32 * 8 + 8
    assert "one FSDP unit" in profile.wrap_reason


def test_large_model_without_repeated_blocks_is_wrapped_by_size() -> None:
    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(4096, 4096)
            self.head = nn.Conv1d(4096, 1024, 3)

    with torch.device("meta"):
        model = Wide()
    profile = analyze_model(model)
    assert profile.block_classes == ()
    assert profile.wrap_min_params is not None
    assert SMALL_UNIT_PARAMS <= profile.wrap_min_params < profile.total_params
    assert "wrap by size" in profile.wrap_reason


def test_nested_repeats_pick_the_block_not_the_stack() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.Linear(256, 256)
            self.ff = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(6))

    class EncDec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.decoder = Stack(), Stack()

    profile = analyze_model(EncDec())
    assert [p.rpartition(".")[2] for p in profile.block_classes] == ["Layer"]
    assert profile.block_count == 12


def test_no_split_modules_wins() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

    class Pretrained(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(1000, 64)
            self.blocks = nn.ModuleList(Block() for _ in range(3))

    profile = analyze_model(Pretrained())
    assert profile.no_split_modules == ("Block",)
    assert [p.rpartition(".")[2] for p in profile.block_classes] == ["Block"]
    assert "_no_split_modules" in profile.wrap_reason
    # 8,320-parameter blocks: the guide's "few thousand parameters" warning fires.
    assert any("communication overhead" in w for w in profile.warnings)


def test_lightning_demo_transformer_blocks_are_the_guides_policy() -> None:
    pytest.importorskip("lightning")
    profile, _ = analyze_target(
        TargetSpec(spec=f"{EXAMPLES}/lightning_transformer.py:build", kwargs={"nlayers": 4})
    )
    assert set(profile.block_classes) == {
        "torch.nn.modules.transformer.TransformerEncoderLayer",
        "torch.nn.modules.transformer.TransformerDecoderLayer",
    }
    assert profile.block_count == 8


def test_70b_analyses_on_meta_with_exact_count() -> None:
    profile, built = analyze_target(TargetSpec(spec=GPT, kwargs={"size": "70b"}))
    d, ffn, layers, vocab, kv = 8192, 28672, 80, 32000, 8 * 128
    block = d * d * 2 + d * 2 * kv + 3 * d * ffn + 2 * d
    assert profile.total_params == layers * block + 2 * vocab * d + d
    assert profile.block_count == 80
    assert all(p.is_meta for p in built.model.parameters())
    assert not profile.warnings  # the root (embedding + head) is smaller than one block


def test_json_output_round_trips(cli) -> None:
    code, out, _ = cli("analyze", GPT, "--arg", "size=tiny", "--json")
    assert code == 0
    profile = ModelProfile.model_validate(json.loads(out))
    assert profile.block_classes == ("gpt.Block",)


def test_table_output_names_the_proposal(cli) -> None:
    code, out, _ = cli("analyze", GPT, "--arg", "size=tiny")
    assert code == 0
    assert "auto_wrap_policy" in out and "gpt.Block" in out
    assert "root unit keeps" in out


def test_stack_of_equal_leaves_is_wrapped_per_layer() -> None:
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    profile = analyze_model(model)
    assert profile.block_classes == ("torch.nn.modules.linear.Linear",)
    assert profile.block_count == 8 and profile.root_unit_params == 0


class _T5Block(nn.Module):
    """An encoder-decoder's block class: the decoder's instances add cross-attention."""

    def __init__(self, d: int, cross: bool) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d, bias=False)
        self.cross = nn.Linear(d, d, bias=False) if cross else None
        self.mlp = nn.Linear(d, 4 * d, bias=False)


class _EncoderDecoder(nn.Module):
    def __init__(self, d: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, d)
        self.encoder = nn.ModuleList(_T5Block(d, cross=False) for _ in range(layers))
        self.decoder = nn.ModuleList(_T5Block(d, cross=True) for _ in range(layers))


def test_a_unit_is_sized_by_the_largest_of_its_repeated_blocks() -> None:
    # encoder blocks hold 5 d^2 parameters, decoder blocks 6 d^2: the unit FSDP gathers is the
    # decoder's (sized by the smallest, the peak reads low)
    d = 64
    with torch.device("meta"):
        model = _EncoderDecoder(d)
    profile = analyze_model(model)
    assert profile.block_classes == (f"{__name__}._T5Block",)
    assert profile.block_count == 6
    assert profile.block_params == 6 * d * d
    assert profile.root_unit_params == 100 * d


def test_the_parameter_dtype_and_a_frozen_root_are_reported() -> None:
    with torch.device("meta"):
        model = _EncoderDecoder(64)
    model.embed.to(torch.bfloat16)  # 6,400 bf16 against 147,456 fp32 parameters
    model.embed.weight.requires_grad_(False)
    profile = analyze_model(model)
    assert profile.param_dtype == "float32"
    assert profile.root_frozen_params == 100 * 64
    model.to(torch.bfloat16)
    assert analyze_model(model).param_dtype == "bfloat16"


# (mutation survivors of autoshard.analyze, scripts/mutation.sh analyze)


class _Wide(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(64, width, bias=False)
        self.down = nn.Linear(width, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x))


class Big(_Wide):
    pass


class Quarter(_Wide):
    pass


class Fifth(_Wide):
    pass


class _Siblings(nn.Module):
    """Four Big blocks, then siblings of another class at 25% and at 20% of a Big's size."""

    def __init__(self) -> None:
        super().__init__()
        self.bigs = nn.ModuleList(Big(400) for _ in range(4))
        self.quarters = nn.ModuleList(Quarter(100) for _ in range(4))
        self.fifths = nn.ModuleList(Fifth(80) for _ in range(4))
        self.scale = nn.Parameter(torch.ones(64))  # the root's own parameter


def test_a_sibling_block_class_is_a_unit_from_a_quarter_of_the_blocks_size() -> None:
    profile = analyze_model(_Siblings())
    path = f"{__name__}.{{}}"
    # Quarter holds 25% of a Big's parameters (a unit of its own); Fifth 20% (left to the root)
    assert profile.block_classes == (path.format("Big"), path.format("Quarter"))
    assert profile.wrap_reason == (
        "repeated blocks Big x4 (51,200 params each), Quarter x4 (12,800 params each) hold "
        "86% of the parameters: one FSDP unit per block gathers one block at a time"
    )


def test_the_roots_own_parameters_are_named_and_ties_warned_word_for_word() -> None:
    model = nn.Module()  # four blocks, a head larger than a block, a parameter of its own
    model.bigs = nn.ModuleList(Big(400) for _ in range(4))
    model.head = nn.Linear(64, 1000, bias=False)
    model.scale = nn.Parameter(torch.ones(64))
    profile = analyze_model(model)
    (root,) = [w for w in profile.warnings if w.startswith("the root unit keeps")]
    assert root == (
        "the root unit keeps 64,064 parameters (24%) outside the wrapped blocks (head 64,000, "
        "<root> 64); they are gathered whole for every step"
    )
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert "tied parameters 0.weight, 1.weight (40) are one tensor: they stay in one FSDP unit" in (
        analyze_model(tied).warnings
    )


def test_frozen_blocks_are_counted_and_where_the_model_was_built_is_kept() -> None:
    model = _Siblings()
    for block in (model.bigs[0], model.bigs[2]):
        block.requires_grad_(False)
    model.bigs[1].up.requires_grad_(False)  # one half-frozen block: the largest that trains
    profile = analyze_model(model, built_on="cpu")
    assert profile.frozen_blocks == 2 and profile.block_frozen_params == 25_600
    assert profile.built_on == "cpu"
    assert analyze_model(model, built_on="cuda:0").built_on == "cpu"  # built on a device
    assert analyze_model(model).built_on == "meta"


def test_the_context_is_the_smallest_limit_found() -> None:
    from autoshard.analyze import find_context

    model = nn.Module()
    model.pos_emb = nn.Embedding(512, 8)
    model.max_seq_len = 1024
    assert find_context(model) == (512, "positional table pos_emb (Embedding(512, 8))")
    model.max_seq_len = 128
    assert find_context(model) == (128, "max_seq_len")
    assert find_context(nn.Linear(2, 2)) is None


def test_the_module_table_keeps_its_first_two_thousand_rows() -> None:
    from autoshard.analyze import MODULE_ROWS

    model = nn.Sequential(nn.ModuleList(nn.Linear(1, 1) for _ in range(2500)))
    rows = analyze_model(model).modules
    assert MODULE_ROWS == 2000 and len(rows) == 2000
    assert [r.name for r in rows[:3]] == ["", "0", "0.0"] and rows[-1].name == "0.1997"
