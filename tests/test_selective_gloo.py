"""Selective (op-level) checkpointing in real FSDP1 and FSDP2 runs on 2 gloo processes, built
and sharded as a trial does (one launch): its peak lies between checkpointing nothing and
everything (in bf16 mixed precision), and both estimators predict it, in bf16 and in fp32, where
the peak moves from the loss to the top block's recompute in backward
(benchmarks/results/selective_checkpointing.md).

This file is also the worker script: the test runs it under ``torch.distributed.run``, which
trains each configuration for two steps under torch's memory tracker
(:func:`autoshard.predict.simulate.measure_training_peak`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import gloo_peaks

ROOT = Path(__file__).resolve().parents[1]
# A step whose activations weigh (512 tokens, a small vocabulary): benchmarks' gpt-long.
TARGET = {
    "spec": f"{ROOT}/examples/gpt.py:build",
    "kwargs": {"size": "tiny", "vocab_size": 1024, "max_seq_len": 512},
}
SEQ = 512
POINTS = [
    dict(engine="fsdp1", precision="bf16-mixed", checkpointing="none"),
    dict(engine="fsdp1", precision="bf16-mixed", checkpointing="selective"),
    dict(engine="fsdp1", precision="bf16-mixed", checkpointing="all"),
    dict(engine="fsdp2", precision="bf16-mixed", checkpointing="selective"),
    dict(engine="fsdp1", precision="32-true", checkpointing="selective"),
    dict(engine="fsdp2", precision="32-true", checkpointing="selective"),
]


def candidates() -> list:
    return gloo_peaks.candidates(TARGET, POINTS)


def main() -> None:
    gloo_peaks.measure_peaks(TARGET, POINTS, SEQ)


@pytest.mark.slow
def test_selective_runs_in_fsdp1_and_fsdp2_between_none_and_all_as_estimated(tmp_path) -> None:
    from autoshard.analyze import analyze_target
    from autoshard.config import Hardware, WorkloadSpec
    from autoshard.predict.activations import precisions_of, profile_activations
    from autoshard.predict.analytic import estimate_memory
    from autoshard.predict.simulate import simulate_memory
    from autoshard.target.resolve import TargetSpec

    none, selective, full, *_ = measured = gloo_peaks.launch(__file__, tmp_path)
    # what the policy keeps costs memory, what it recomputes saves some
    assert full < selective < none, measured

    target = TargetSpec(**TARGET)
    profile, built = analyze_target(target)
    workload = WorkloadSpec(seq_len=SEQ)
    cands = candidates()
    acts = profile_activations(built.model, profile, workload, precisions=precisions_of(cands))
    gloo = Hardware(gpus_per_node=2, gpu_memory=80 * 1024**3, backend="gloo")
    for candidate, real in zip(cands, measured, strict=True):
        if candidate.checkpointing.value != "selective":
            continue
        sim = simulate_memory(
            target, candidate, gloo, workload, block_classes=profile.block_classes
        )
        ana = estimate_memory(profile, candidate, gloo, workload, activations=acts)
        assert abs(sim.gpu_peak - real) <= 0.03 * real, (candidate.label(), sim.gpu_peak, real)
        assert abs(ana.gpu_peak - real) <= 0.05 * real, (candidate.label(), ana.gpu_peak, real)


if __name__ == "__main__":
    main()
