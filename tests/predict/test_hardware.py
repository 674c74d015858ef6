"""The hardware a prediction is made for (autoshard/predict/hardware.py): the catalogue's GPU or the
overrides, the CPU measured for gloo ranks, and the dense rate of each precision."""

from __future__ import annotations

from autoshard.config import Hardware
from autoshard.gpus import CATALOGUE
from autoshard.predict.hardware import dense_flops, speed_for


def test_fp32_runs_at_the_fp32_rate_unless_tf32() -> None:
    h100 = CATALOGUE["h100-sxm"]
    assert dense_flops(h100, "32-true") == h100.fp32_flops  # type: ignore[arg-type]
    assert dense_flops(h100, "32-true", tf32=True) == h100.tf32_flops  # type: ignore[arg-type]


def test_speed_for_resolves_the_catalogue_and_the_overrides() -> None:
    gpu, note = speed_for(Hardware(gpu_memory=40 * 2**30, gpu="a100-40gb-pcie"))
    assert gpu == CATALOGUE["a100-40gb-pcie"] and note == ""
    fast = Hardware(gpu_memory=1, gpu="l4", intra_node_bandwidth=1e9, inter_node_bandwidth=2e9)
    gpu, _ = speed_for(fast)
    assert (gpu.intra_node_bandwidth, gpu.inter_node_bandwidth) == (1e9, 2e9)
    gpu, note = speed_for(Hardware(gpu_memory=1))
    assert gpu.id == "h100-sxm" and "assumed" in note
    cpu, note = speed_for(Hardware(gpu_memory=1, gpus_per_node=2, backend="gloo"))
    assert cpu.id == "cpu-gloo" and note == ""
    assert 1e8 < cpu.fp32_flops < 1e13  # measured here: one core's matmul rate
