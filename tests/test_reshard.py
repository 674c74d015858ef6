"""FSDP2 reshard policies as a search dimension: validated, labelled, enumerated, applied per
unit, and estimated (the root, and the last block, kept gathered from forward into backward)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from autoshard.analyze import analyze_target
from autoshard.config import Candidate, Engine, Hardware, Reshard, Sharding, WorkloadSpec
from autoshard.engine import reshard_after_forward
from autoshard.predict.activations import profile_activations
from autoshard.predict.analytic import estimate_memory
from autoshard.predict.simulate import simulate_memory
from autoshard.space import Knobs, enumerate_candidates
from autoshard.target.resolve import TargetSpec

from .conftest import EXAMPLES

GIB = 1024**3
BLOCK = ("gpt.Block",)


def test_label_names_the_policy_and_fsdp1_refuses_one() -> None:
    base = dict(engine="fsdp2", wrap_classes=BLOCK, precision="bf16-mixed")
    assert Candidate(**base).label() == "fsdp2 FULL_SHARD bf16-mixed mbs1"
    assert Candidate(**base, reshard="keep_root").label() == (
        "fsdp2 FULL_SHARD bf16-mixed keep-root mbs1"
    )
    assert "keep-root-and-last" in Candidate(**base, reshard="keep_root_and_last").label()
    with pytest.raises(ValidationError, match="reshard=keep_root needs engine fsdp2"):
        Candidate(wrap_classes=BLOCK, reshard="keep_root")


@pytest.mark.parametrize(
    ("sharding", "reshard", "root", "last", "other"),
    [
        ("FULL_SHARD", "all", True, True, True),
        ("FULL_SHARD", "keep_root", False, True, True),
        ("FULL_SHARD", "keep_root_and_last", False, False, True),
        ("SHARD_GRAD_OP", "all", False, False, False),
    ],
)
def test_reshard_after_forward_per_unit(sharding, reshard, root, last, other) -> None:
    c = Candidate(engine="fsdp2", wrap_classes=BLOCK, sharding=sharding, reshard=reshard)
    assert reshard_after_forward(c, root=True) is root
    assert reshard_after_forward(c, last=True) is last
    assert reshard_after_forward(c) is other


@pytest.fixture(scope="module")
def gpt_tiny():
    target = TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"})
    profile, built = analyze_target(target)
    workload = WorkloadSpec(seq_len=128)
    acts = profile_activations(built.model, profile, workload, precisions=("bf16-mixed", "32-true"))
    return target, profile, workload, acts


def test_space_enumerates_the_policies_where_they_differ(gpt_tiny) -> None:
    _, profile, workload, _ = gpt_tiny
    hw = Hardware(gpus_per_node=8, nodes=2, gpu_memory=80 * GIB)
    fsdp2 = enumerate_candidates(profile, hw, workload, Knobs(engine=Engine.FSDP2))
    by_sharding: dict[Sharding, set[Reshard]] = {}
    for c in fsdp2:
        if not c.one_unit and not c.cpu_offload:
            by_sharding.setdefault(c.sharding, set()).add(c.reshard)
    assert by_sharding[Sharding.FULL_SHARD] == set(Reshard)
    assert by_sharding[Sharding.HYBRID_SHARD] == set(Reshard)
    assert by_sharding[Sharding.SHARD_GRAD_OP] == {Reshard.ALL}
    assert by_sharding[Sharding.NO_SHARD] == {Reshard.ALL}
    assert all(c.reshard is Reshard.ALL for c in fsdp2 if c.cpu_offload or c.one_unit)
    assert len({c.key() for c in fsdp2}) == len(fsdp2)  # no duplicates
    pinned = enumerate_candidates(
        profile, hw, workload, Knobs(engine=Engine.FSDP2, reshards=("keep_root",))
    )
    kept = {
        c.reshard
        for c in pinned
        if c.sharding is Sharding.FULL_SHARD and not (c.one_unit or c.cpu_offload)
    }
    assert kept == {Reshard.KEEP_ROOT}
    fsdp1 = enumerate_candidates(profile, hw, workload)
    assert {c.reshard for c in fsdp1} == {Reshard.ALL}


def test_keeping_the_root_costs_its_bytes_at_the_loss(gpt_tiny) -> None:
    """The tiny GPT's root (a 4096-token embedding and head: 1.1M of 1.9M parameters) stays
    gathered from forward into backward: the peak, at the loss, grows by the root in bf16;
    keeping the last block too adds one block."""
    _, profile, workload, acts = gpt_tiny
    hw = Hardware(gpus_per_node=8, gpu_memory=80 * GIB)
    peaks = {}
    for reshard in Reshard:
        c = Candidate(engine="fsdp2", wrap_classes=profile.wrap_policy, reshard=reshard)
        e = estimate_memory(profile, c, hw, workload, activations=acts)
        assert e.peak_at == "loss", e.peak_at
        peaks[reshard] = e.gpu_peak - e.breakdown.allowance
    root_bytes = profile.root_unit_params * 2
    block_bytes = profile.block_params * 2
    assert peaks[Reshard.KEEP_ROOT] - peaks[Reshard.ALL] == root_bytes
    assert peaks[Reshard.KEEP_ROOT_AND_LAST] - peaks[Reshard.KEEP_ROOT] == block_bytes


@pytest.mark.parametrize("reshard", ["keep_root", "keep_root_and_last"])
def test_the_simulation_keeps_the_same_units_gathered(gpt_tiny, reshard: str) -> None:
    """Real FSDP2 on fake tensors agrees: the kept units' bytes, to within 1% of the peak."""
    target, profile, workload, acts = gpt_tiny
    hw = Hardware(gpus_per_node=8, gpu_memory=80 * GIB)
    peaks = {}
    for policy in ("all", reshard):
        c = Candidate(engine="fsdp2", wrap_classes=profile.wrap_policy, reshard=policy)
        sim = simulate_memory(target, c, hw, workload, block_classes=profile.block_classes)
        ana = estimate_memory(profile, c, hw, workload, activations=acts)
        peaks[policy] = sim.gpu_peak - sim.breakdown.allowance
        # the counted bytes (the analytic allowance also holds FSDP2's stream pools, which a
        # simulation is given only by the plan: refine_with_simulation)
        counted = ana.gpu_peak - ana.breakdown.allowance
        assert abs(counted - peaks[policy]) <= 0.01 * peaks[policy], policy
    kept = profile.root_unit_params + (profile.block_params if reshard.endswith("last") else 0)
    assert abs((peaks[reshard] - peaks["all"]) - 2 * kept) <= 0.01 * peaks["all"]
