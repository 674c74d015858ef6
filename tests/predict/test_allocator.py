"""What the CUDA caching allocator reserves beyond the allocated peak
(autoshard/predict/allocator.py): FSDP2's stream pools, planned in the allowance, and the loss's
hole."""

from __future__ import annotations

import pytest

from autoshard.analyze import analyze_target
from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.predict.activations import profile_activations
from autoshard.predict.analytic import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    allowance,
    estimate_memory,
    estimate_reserved,
    stream_pools_of,
)
from autoshard.predict.simulate import refine_with_simulation
from autoshard.target.resolve import TargetSpec

from ..conftest import EXAMPLES

# a large vocabulary against a small body, so the loss holds the peak (as in torchtitan's 8B)
SPEC = TargetSpec(
    spec=f"{EXAMPLES}/gpt.py:build",
    kwargs={"size": "tiny", "n_layer": 2, "d_model": 128, "vocab_size": 32768},
)
SEQ, MBS, GPUS = 256, 4, 8


@pytest.fixture(scope="module")
def stack():  # type: ignore[no-untyped-def]
    profile, built = analyze_target(SPEC)
    workload = WorkloadSpec(seq_len=SEQ, loop="plain")  # zero_grad after step: no gradient
    acts = profile_activations(built.model, profile, workload)  # at the loss
    return profile, workload, acts


def _candidate(profile, **kw) -> Candidate:  # type: ignore[no-untyped-def]
    return Candidate(wrap_classes=profile.wrap_policy, micro_batch_size=MBS, **kw)


def test_fsdp2_reserves_its_gradient_shards_and_largest_gather_beside_the_loss(stack) -> None:
    profile, workload, acts = stack
    hw = Hardware(gpus_per_node=GPUS, gpu_memory=80 * 2**30)
    candidate = _candidate(profile, engine="fsdp2", precision="bf16-mixed")
    estimate = estimate_memory(profile, candidate, hw, workload, activations=acts)
    assert estimate.peak_at == "loss" and estimate.breakdown.gradients == 0
    peak = estimate_reserved(profile, candidate, hw, workload, activations=acts)
    # fp32 gradient shards on the reduce-scatter stream; the root unit's bf16 all-gather
    # output (embedding and head) on the all-gather stream
    shards = profile.total_params * 4 // GPUS
    gathered = max(profile.root_unit_params, 2 * profile.block_params) * 2
    assert peak.stream_pools == shards + gathered
    # the bf16 logits freed before backward: the log-probabilities' gradients cannot reuse them
    assert peak.loss_hole == MBS * SEQ * profile.vocab_size * 2
    assert peak.allocated == estimate.breakdown.total - estimate.breakdown.allowance
    # the planner holds the stream pools against the device beside the CUDA context and the
    # slack; the loss's hole is left to the slack (deduced, not measured)
    slack = int(peak.allocated * ALLOCATOR_SLACK)
    assert estimate.breakdown.allowance == CUDA_CONTEXT_BYTES + peak.stream_pools + slack
    # one rank: FSDP2 gathers nothing (it copies on the default stream); the gradients still
    # come from its reduce-scatter stream
    one = hw.model_copy(update={"gpus_per_node": 1})
    alone = estimate_reserved(profile, candidate, one, workload, activations=acts)
    assert alone.stream_pools == profile.total_params * 4


def test_nothing_is_reserved_beyond_what_is_not_modelled(stack) -> None:
    profile, workload, acts = stack
    hw = Hardware(gpus_per_node=GPUS, gpu_memory=80 * 2**30)
    # FSDP1's streams are not modelled; fp32 logits are not cast, so no 16-bit copy is freed
    fsdp1 = estimate_reserved(
        profile, _candidate(profile, engine="fsdp1"), hw, workload, activations=acts
    )
    assert fsdp1.stream_pools == 0 and fsdp1.loss_hole > 0
    fp32 = _candidate(profile, engine="fsdp2", precision="32-true")
    assert estimate_reserved(profile, fp32, hw, workload, activations=acts).loss_hole == 0
    # CPU processes have no caching allocator: the golden CPU estimates do not move
    gloo = hw.model_copy(update={"backend": "gloo"})
    bf16 = _candidate(profile, engine="fsdp2", precision="bf16-mixed")
    cpu = estimate_reserved(profile, bf16, gloo, workload, activations=acts)
    assert cpu.reserved == cpu.allocated
    assert estimate_memory(profile, bf16, gloo, workload, activations=acts).breakdown.allowance == 0


def test_a_simulated_estimate_plans_the_same_stream_pools(stack) -> None:
    """--simulate replaces the analytic estimate of the best candidates: the pools it planned on
    stay in the allowance (the tracker sees the allocated bytes only)."""
    profile, workload, acts = stack
    hw = Hardware(gpus_per_node=GPUS, gpu_memory=80 * 2**30)
    candidate = _candidate(profile, engine="fsdp2", precision="bf16-mixed")
    analytic = estimate_memory(profile, candidate, hw, workload, activations=acts)
    pools = stream_pools_of(analytic, hw)
    assert (
        pools == estimate_reserved(profile, candidate, hw, workload, activations=acts).stream_pools
    )
    (simulated,) = refine_with_simulation(
        SPEC, [analytic], hw, workload, block_classes=profile.block_classes, count=1
    )
    assert simulated.method == "simulated"
    counted = simulated.gpu_peak - simulated.breakdown.allowance
    assert simulated.breakdown.allowance == allowance(counted, hw) + pools > 0
