"""The speed model's uncalibrated factors (autoshard/predict/factors.py): a GPU host's are the
measured ones scaled, CPU processes have their own, and each GPU generation gets its own step
efficiency."""

from __future__ import annotations

import pytest

from autoshard.gpus import CATALOGUE
from autoshard.predict.factors import DEFAULT_FACTORS, GPU_HOST_SCALE, default_factors


def test_a_gpu_hosts_factors_are_the_measured_ones_scaled_cpu_processes_their_own() -> None:
    h200 = default_factors(CATALOGUE["h200"])
    assert h200.op_overhead_s == pytest.approx(DEFAULT_FACTORS.op_overhead_s * GPU_HOST_SCALE)
    assert h200.unit_host_scale == pytest.approx(GPU_HOST_SCALE)
    assert h200.compute_efficiency == CATALOGUE["h200"].step_efficiency


def test_each_gpu_generation_gets_its_own_step_efficiency() -> None:
    # A100s reach a larger share of their achievable rate than Hoppers (the fitting set's
    # published HFU): the uncalibrated factors differ in that one number.
    a100, h100 = CATALOGUE["a100-80gb-sxm"], CATALOGUE["h100-sxm"]
    assert (a100.step_efficiency, h100.step_efficiency, CATALOGUE["h200"].step_efficiency) == (
        0.75, 0.6, 0.6,
    )  # fmt: skip
    assert default_factors(a100).compute_efficiency == 0.75
    assert default_factors(h100).compute_efficiency == 0.6
    assert default_factors(h100).model_copy(update={"compute_efficiency": 0.75}) == (
        default_factors(a100)
    )
    assert default_factors(CATALOGUE["l4"]).compute_efficiency == 0.7  # none published
