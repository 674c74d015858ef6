"""The activation profile (predict/activations.py): what a fake forward of each block saves,
counted once per repeated block, per precision, with a fallback where a precision cannot run.
Moved from tests/test_estimate.py, which keeps the analytic estimate's use of the profile."""

from __future__ import annotations

import torch
from torch import nn

from autoshard.analyze import analyze_model
from autoshard.config import Precision, WorkloadSpec
from autoshard.predict.activations import profile_activations
from autoshard.target.resolve import TargetSpec, build_target

from ..conftest import EXAMPLES


def test_repeated_blocks_are_counted_as_if_each_had_run(monkeypatch) -> None:
    """Blocks with the same signature run once; the count must equal running every block,
    including tensors every block is given (a shared table saved by the first block only).
    The FLOP count shares the set-up (:func:`autoshard.predict.fakes.fake_model`): likewise."""
    import autoshard.predict.fakes as fakes
    from autoshard.predict.flops import profile_flops

    target = TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny", "n_layer": 6})
    built = build_target(target)
    profile = analyze_model(built.model)
    w = WorkloadSpec(seq_len=64)
    precisions = (Precision.FP32, Precision.BF16_MIXED)
    reused = profile_activations(built.model, profile, w, precisions=precisions)
    reused_flops = profile_flops(built.model, profile, w)
    monkeypatch.setattr(fakes, "block_signature", lambda module: (id(module),))  # no two alike
    every = profile_activations(built.model, profile, w, precisions=precisions)
    assert profile_flops(built.model, profile, w) == reused_flops and reused_flops.measured
    assert reused.measured and every.measured
    for a, b in zip((reused, *reused.others), (every, *every.others), strict=True):
        assert a.block_bytes == b.block_bytes and len(set(a.block_bytes)) == 1
        assert a.block_input_bytes == b.block_input_bytes and a.other_bytes == b.other_bytes


class Picky(nn.Module):
    """A model whose forward runs in fp32 only, or (``fake_hostile``) not on fake tensors."""

    def __init__(self, fake_hostile: bool = False) -> None:
        super().__init__()
        self.fake_hostile = fake_hostile
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fake_hostile:
            self.layers[0](x).nonzero()  # a data-dependent shape: fake tensors have no data
        if self.layers[0].weight.dtype != torch.float32:
            raise TypeError("this model only runs in fp32")
        return self.layers(x)


def test_a_precision_that_cannot_be_profiled_falls_back_to_one_that_can() -> None:
    with torch.device("meta"):
        model = Picky()
    profile = analyze_model(model)
    batch = torch.zeros(2, 8, 64)
    acts = profile_activations(
        model, profile, WorkloadSpec(), batch=batch,
        precisions=(Precision.BF16_MIXED, Precision.FP32),
    )  # fmt: skip
    assert acts.measured and acts.precision is Precision.FP32 and acts.others == ()
    assert acts.at(Precision.BF16_MIXED) is acts  # scaled by element size instead
    assert "bf16-mixed" in acts.note and "only runs in fp32" in acts.note
    assert sum(acts.block_bytes) + acts.other_bytes > 0

    with torch.device("meta"):
        hostile = Picky(fake_hostile=True)
    fallback = profile_activations(hostile, analyze_model(hostile), WorkloadSpec(), batch=batch)
    assert not fallback.measured and "did not run on fake tensors" in fallback.note


def test_precisions_given_by_name_are_profiled_as_the_enums_are() -> None:
    """``precisions=("16-mixed", "32-true")`` from a Python caller: profiled on fake tensors as
    the enums are (a plain string used to fail inside and fall back to the rule of thumb)."""
    built = build_target(TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"}))
    profile, w = analyze_model(built.model), WorkloadSpec(seq_len=64)
    by_name = profile_activations(built.model, profile, w, precisions=("16-mixed", "32-true"))
    by_enum = profile_activations(
        built.model, profile, w, precisions=(Precision.FP16_MIXED, Precision.FP32)
    )
    assert by_name.measured and not by_name.note
    assert by_name.precision is Precision.BF16_MIXED  # 16-mixed saves what bf16-mixed does
    assert by_name == by_enum
