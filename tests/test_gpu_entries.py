"""The GPU entries' own facts (autoshard/gpu_entries.py): the achievable rates the published
measurements give and the datasheet numbers of the newest entries. Moved from tests/test_gpus.py,
which keeps the catalogue's completeness and how device names map to entries."""

from __future__ import annotations

import pytest

from autoshard.gpus import CATALOGUE


def test_achievable_rates_are_the_published_measurements() -> None:
    # Large bf16 products (the MAMF table): 794.5 TFLOP/s on an H100 SXM, 271.2 on an A100
    # SXM; FlashAttention-2 reaches 35% of an H100's peak and a larger share of an A100's.
    h100, a100 = CATALOGUE["h100-sxm"], CATALOGUE["a100-80gb-sxm"]
    assert h100.bf16_flops * h100.matmul_fraction == pytest.approx(794.5e12, rel=1e-3)
    assert a100.bf16_flops * a100.matmul_fraction == pytest.approx(271.2e12, rel=1e-3)
    assert h100.attention_fraction == 0.35
    assert h100.attention_fraction < a100.attention_fraction < a100.matmul_fraction
    assert any("ml-engineering" in s for s in h100.sources)
    assert any("2407.08608" in s for s in h100.sources)  # the FlashAttention-3 paper
    for spec in CATALOGUE.values():  # every GPU: a share of its peak, attention the smaller
        assert 0 < spec.attention_fraction <= spec.matmul_fraction <= 1


@pytest.mark.parametrize(
    ("gpu_id", "dense", "source"),
    [
        ("h200-nvl", {"bf16_flops": 835.5e12, "fp8_flops": 1670.5e12, "fp32_flops": 60e12},
         "H200 NVL: 141 GB HBM3e, 4.8 TB/s"),
        ("b200", {"bf16_flops": 2250e12, "fp8_flops": 4500e12, "fp32_flops": 75e12},
         "FP8/FP6 9*, FP16/BF16 4.5*"),
    ],
)  # fmt: skip
def test_the_h200_nvl_and_the_b200_are_entries_with_their_datasheets(
    gpu_id: str, dense: dict[str, float], source: str
) -> None:
    spec = CATALOGUE[gpu_id]
    for field, value in dense.items():
        assert getattr(spec, field) == pytest.approx(value), field
    assert any(source in s for s in spec.sources)
    assert spec.fp8_flops is not None and spec.fp8_flops == pytest.approx(
        2 * spec.bf16_flops, rel=1e-3
    )
