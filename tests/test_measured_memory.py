"""Both estimators against memory measured in real FSDP runs on 2 gloo processes.

This file is also the worker script: the test runs it under ``torch.distributed.run``, which
trains each configuration for two steps under torch's memory tracker
(:func:`autoshard.predict.simulate.measure_training_peak`, what ``benchmarks/estimate_accuracy.py``
runs over its whole grid).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import gloo_peaks

ROOT = Path(__file__).resolve().parents[1]
TARGET = {"spec": f"{ROOT}/examples/gpt.py:build", "kwargs": {"size": "tiny"}}
SEQ = 128
# FSDP2 with bf16 at micro-batch 1 peaks while gloo reduce-scatters the root's gradients (a copy
# of its input that NCCL does not make); FSDP1 with fp32 peaks in the root's backward.
POINTS = [
    dict(engine="fsdp2", sharding="FULL_SHARD", precision="bf16-mixed", checkpointing="all"),
    dict(engine="fsdp1", sharding="FULL_SHARD", precision="32-true", checkpointing="none"),
]


def candidates() -> list:
    return gloo_peaks.candidates(TARGET, POINTS)


def main() -> None:
    gloo_peaks.measure_peaks(TARGET, POINTS, SEQ)


@pytest.mark.slow
def test_estimates_planned_for_gloo_match_measured_gloo_runs(tmp_path) -> None:
    from autoshard.analyze import analyze_target
    from autoshard.config import Hardware, WorkloadSpec
    from autoshard.predict.activations import precisions_of, profile_activations
    from autoshard.predict.analytic import estimate_memory
    from autoshard.predict.simulate import simulate_memory
    from autoshard.target.resolve import TargetSpec

    measured = gloo_peaks.launch(__file__, tmp_path)

    target = TargetSpec(**TARGET)
    profile, built = analyze_target(target)
    workload = WorkloadSpec(seq_len=SEQ)
    cands = candidates()
    acts = profile_activations(built.model, profile, workload, precisions=precisions_of(cands))
    gloo = Hardware(gpus_per_node=2, gpu_memory=80 * 1024**3, backend="gloo")
    nccl = gloo.model_copy(update={"backend": "nccl"})
    for candidate, real in zip(cands, measured, strict=True):
        sim = simulate_memory(
            target, candidate, gloo, workload, block_classes=profile.block_classes
        )
        ana = estimate_memory(profile, candidate, gloo, workload, activations=acts)
        assert sim.breakdown.allowance == ana.breakdown.allowance == 0  # no CUDA on CPU
        assert abs(sim.gpu_peak - real) <= 0.05 * real, (candidate.label(), sim.gpu_peak, real)
        assert abs(ana.gpu_peak - real) <= 0.10 * real, (candidate.label(), ana.gpu_peak, real)
    # The FSDP2 point's peak is gloo's copy: planned for NCCL, the same run needs less.
    in_place = simulate_memory(
        target, cands[0], nccl, workload, block_classes=profile.block_classes
    )
    assert in_place.gpu_peak - in_place.breakdown.allowance < 0.9 * measured[0]


if __name__ == "__main__":
    main()
