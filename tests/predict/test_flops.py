"""The FLOP profile (autoshard/predict/flops.py): a transformer block's count against the formula,
attention counted apart and growing with the square of the sequence, Hugging Face models counted
on fake tensors, and the 6 x parameters x tokens fallback where a forward cannot run on them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from autoshard.analyze import analyze_model
from autoshard.config import WorkloadSpec
from autoshard.predict.flops import profile_flops
from tests.predict.linear_chain import Block

from .test_speed import BLOCKS, D, _gpt_flops


def test_flops_of_a_transformer_block_match_the_formula() -> None:
    # examples/gpt.py's Llama-style block: q and o (d x d), kv (d x 2 kv_dim), MLP up
    # (d x 2 ffn) and down (ffn x d): 2 x T x params forward, plus causal attention: two
    # T x T x d products, half of them computed.
    from examples.gpt import build

    d, heads, kv_heads, ffn, seq = 256, 8, 2, 512, 64
    with torch.device("meta"):
        model = build("1b", n_layer=3, n_head=heads, n_kv_head=kv_heads, d_model=d,
                      ffn_hidden=ffn, vocab_size=1000)  # fmt: skip
    profile = analyze_model(model)
    flops = profile_flops(model, profile, WorkloadSpec(seq_len=seq))
    assert flops.measured, flops.note
    kv = 2 * kv_heads * (d // heads)
    matmuls = d * d + d * kv + d * d + d * 2 * ffn + ffn * d
    attention = 2 * (2 * seq * seq * d) // 2
    assert flops.block_forward == (2 * seq * matmuls + attention,) * 3
    # backward: twice the products, 2.5x the attention (torch's flash backward formula)
    assert flops.block_backward == (2 * 2 * seq * matmuls + 5 * attention // 2,) * 3
    assert flops.other_forward == 2 * seq * d * 1000  # the head
    assert flops.other_backward == 2 * flops.other_forward


def test_attention_flops_are_counted_apart_and_grow_with_the_square_of_the_sequence() -> None:
    short, long = _gpt_flops(64), _gpt_flops(128)
    d = 128
    for flops, seq in ((short, 64), (long, 128)):
        # causal: half of two seq x seq x d products forward, 2.5x that backward
        forward = 2 * (2 * seq * seq * d) // 2
        assert flops.block_forward_attention == (forward,) * 2
        assert flops.block_backward_attention == (5 * forward // 2,) * 2
        assert flops.other_forward_attention == flops.other_backward_attention == 0
        assert 0 < flops.attention < flops.total
    # twice the sequence: 4x the attention, 2x the matrix products
    assert long.attention == 4 * short.attention
    assert long.total - long.attention == 2 * (short.total - short.attention)


@pytest.mark.parametrize("example", ["hf_gpt2", "hf_t5"])
def test_hugging_face_models_are_counted_on_fake_tensors(example: str) -> None:
    # GPT-2 and T5's decoder pass a key/value cache object to their blocks, holding tensors of
    # the model's pass: both must be counted, not estimated.
    pytest.importorskip("transformers")
    from autoshard.analyze import analyze_target
    from autoshard.target.resolve import TargetSpec

    root = Path(__file__).resolve().parents[2]
    profile, built = analyze_target(TargetSpec(spec=f"{root}/examples/{example}.py:build"))
    flops = profile_flops(built.model, profile, WorkloadSpec(), batch=built.batch)
    assert flops.measured, flops.note
    assert len(flops.block_forward) == profile.block_count
    assert all(b > f > 0 for f, b in zip(flops.block_forward, flops.block_backward, strict=True))


def test_a_forward_that_cannot_run_on_fake_tensors_falls_back_to_six_n_t() -> None:
    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block(D) for _ in range(BLOCKS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.tolist()  # data-dependent: fails on fake tensors
            return x

    with torch.device("meta"):
        model = Opaque()
    profile = analyze_model(model)
    flops = profile_flops(model, profile, WorkloadSpec(seq_len=10), batch=torch.randn(1, D))
    assert not flops.measured and "6 x parameters x tokens" in flops.note
    assert flops.total == 6 * profile.total_params * 10
