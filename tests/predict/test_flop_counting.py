"""Counting what operations on fake tensors cost (autoshard/predict/flop_counting.py): grouped-query
attention counted where torch's formula wants equal heads (torch 2.11's, stood in here;
scripts/torch_tier.sh runs this file on that torch too), and the query heads a grouped key/value
is repeated to."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autoshard.config import WorkloadSpec
from autoshard.predict import flop_counting


def _equal_heads(formula: Any) -> Any:
    """torch 2.11's SDPA formula: this torch's, refusing shapes whose heads differ."""

    def counted(*shapes: Any) -> int:
        if len({shape[1] for shape in shapes}) != 1:
            raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
        return int(formula(*shapes))

    return counted


def _gqa_profile() -> Any:
    from autoshard import analyze_model
    from autoshard.predict.flops import profile_flops
    from examples.gpt import GPT

    with torch.device("meta"):
        model = GPT(n_layer=2, n_head=8, n_kv_head=2, d_model=256, ffn_hidden=512,
                    vocab_size=512, mlp="swiglu", max_seq_len=128)  # fmt: skip
    return profile_flops(model, analyze_model(model), WorkloadSpec(seq_len=128))


def test_grouped_query_attention_is_counted_where_the_formula_wants_equal_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    this_torch = _gqa_profile()
    assert this_torch.measured
    for name in ("sdpa_flop_count", "sdpa_backward_flop_count"):
        monkeypatch.setattr(flop_counting, name, _equal_heads(getattr(flop_counting, name)))
    strict = _gqa_profile()
    assert strict.measured, strict.note
    assert strict == this_torch  # FLOPs, traffic (what compile and float8 act on), all


def test_query_heads_repeat_grouped_key_value_heads_only() -> None:
    q = (2, 8, 128, 32)
    assert flop_counting._query_heads(q, (2, 2, 128, 32)) == (2, 8, 128, 32)
    assert flop_counting._query_heads(q, (2, 8, 128, 32)) == (2, 8, 128, 32)
    assert flop_counting._query_heads(q, (2, 3, 128, 32)) == (2, 3, 128, 32)  # not a group
