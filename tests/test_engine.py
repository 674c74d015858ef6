"""The engine policies (autoshard/engine.py): each rule of what FSDP1 and FSDP2 do, answered once,
and the trials' set-up, the timeline and the memory model all reading the same answer."""

from __future__ import annotations

import pytest
from torch import nn

from autoshard import engine, sharding
from autoshard.analyze import analyze_model
from autoshard.config import (
    BackwardPrefetch,
    Candidate,
    Engine,
    Hardware,
    Loop,
    Precision,
    Reshard,
    Sharding,
    WorkloadSpec,
)
from autoshard.engine import as_run, policy_of, reduce_bytes, shard_group, skips_gradient_sync

GIB = 2**30
EIGHT = Hardware(gpus_per_node=8, gpu_memory=80 * GIB)


def fsdp(name: str, **kw: object) -> Candidate:
    return Candidate(engine=Engine(name), wrap_classes=("torch.nn.Linear",), **kw)


def test_mixed_precision_is_named_once() -> None:
    assert [p.value for p in Precision if p.mixed] == ["bf16-mixed", "16-mixed"]


def test_fsdp1_reduces_in_the_compute_dtype_and_fsdp2_in_fp32_under_mixed_precision() -> None:
    assert reduce_bytes(fsdp("fsdp1")) == 2  # Lightning's MixedPrecision: reduce_dtype=bf16
    assert reduce_bytes(fsdp("fsdp2")) == 4
    assert reduce_bytes(fsdp("fsdp2", reduce_dtype_fp32=False)) == 2
    assert reduce_bytes(fsdp("fsdp2", precision="bf16-true")) == 2  # nothing to upcast
    assert reduce_bytes(fsdp("fsdp1", precision="32-true")) == 4


def test_the_shard_group_of_every_sharding() -> None:
    world = Hardware(gpus_per_node=8, nodes=4, gpu_memory=80 * GIB)
    assert shard_group(fsdp("fsdp1"), world) == (32, 1)
    assert shard_group(fsdp("fsdp1", sharding="SHARD_GRAD_OP"), world) == (32, 1)
    assert shard_group(fsdp("fsdp1", sharding="NO_SHARD"), world) == (1, 32)
    hybrid = fsdp("fsdp2", sharding="HYBRID_SHARD", hybrid_mesh=(4, 8))
    assert shard_group(hybrid, world) == (8, 4)  # (shard, replicas) of a (replicate, shard) mesh


def test_fsdp1_runs_no_shard_on_one_rank_and_fsdp2_shards_as_asked() -> None:
    one = Hardware(gpus_per_node=1, gpu_memory=80 * GIB)
    assert as_run(fsdp("fsdp1"), one).sharding is Sharding.NO_SHARD
    assert as_run(fsdp("fsdp1"), EIGHT).sharding is Sharding.FULL_SHARD
    assert as_run(fsdp("fsdp2"), one).sharding is Sharding.FULL_SHARD


def test_which_loop_skips_the_gradient_sync_under_accumulation() -> None:
    table = {
        (name, loop.value, accumulate): skips_gradient_sync(
            fsdp(name), WorkloadSpec(loop=loop, accumulate=accumulate)
        )
        for name in ("fsdp1", "fsdp2")
        for loop in (Loop.LIGHTNING, Loop.PLAIN)
        for accumulate in (1, 4)
    }
    assert {key for key, skips in table.items() if skips} == {
        ("fsdp1", "lightning", 4),  # Lightning's Trainer runs FSDP1's no_sync
        ("fsdp1", "plain", 4),
        ("fsdp2", "plain", 4),  # set_requires_gradient_sync(False); Lightning has none for FSDP2
    }


@pytest.mark.parametrize("reshard", list(Reshard))
def test_backward_gathers_again_what_the_trials_reshard_after_forward(reshard: Reshard) -> None:
    """FSDP2's units are gathered again in backward exactly where the trials pass
    ``reshard_after_forward=True`` to ``fully_shard``: one rule for both."""
    assert sharding.reshard_after_forward is engine.reshard_after_forward
    candidate = fsdp("fsdp2", reshard=reshard)
    policy = policy_of(candidate)
    for unit in ({"root": True}, {"last": True}, {}):
        assert policy.regathers(candidate, **unit) is engine.reshard_after_forward(
            candidate, **unit
        )
    kept = policy.keeps_after_forward(candidate, root=1000, unit=10)
    assert (
        kept == {Reshard.ALL: 0, Reshard.KEEP_ROOT: 1000, Reshard.KEEP_ROOT_AND_LAST: 1010}[reshard]
    )
    grad_op = fsdp("fsdp2", reshard=reshard, sharding="SHARD_GRAD_OP")
    assert not policy.regathers(grad_op, root=True) and not policy.regathers(grad_op)


def test_fsdp1_keeps_the_root_gathered_into_backward_and_gathers_the_blocks_again() -> None:
    candidate = fsdp("fsdp1")
    policy = policy_of(candidate)
    assert not policy.regathers(candidate, root=True)
    assert policy.regathers(candidate, last=True) and policy.regathers(candidate)
    assert policy.keeps_after_forward(candidate, root=1000, unit=10) == 1000
    assert not policy.regathers(fsdp("fsdp1", sharding="SHARD_GRAD_OP"))


def test_backward_prefetch_is_fsdp1s_choice_and_fsdp2s_default() -> None:
    post = fsdp("fsdp1", backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    assert policy_of(fsdp("fsdp1")).prefetches_backward(fsdp("fsdp1"))
    assert not policy_of(post).prefetches_backward(post)
    assert policy_of(fsdp("fsdp2")).prefetches_backward(fsdp("fsdp2"))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.a(x))


def test_fsdp1_gives_a_unit_a_whole_gradient_when_one_of_its_parameters_trains() -> None:
    """FSDP1's flat parameter trains as one: a block with one frozen Linear keeps a gradient of
    the whole block; FSDP2's per-parameter gradients leave the frozen one out."""
    model = nn.Sequential(nn.Embedding(64, 16), _Block(), _Block(), nn.Linear(16, 64))
    model[1].a.requires_grad_(False)
    model[2].a.requires_grad_(False)
    profile = analyze_model(model)
    block = 2 * (16 * 16 + 16)
    wrap = (f"{_Block.__module__}.{_Block.__qualname__}",)
    one, two = (Candidate(engine=e, wrap_classes=wrap) for e in (Engine.FSDP1, Engine.FSDP2))
    trained1, root1, unit1 = policy_of(one).gradient_params(profile, one)
    trained2, root2, unit2 = policy_of(two).gradient_params(profile, two)
    assert unit1 == block and unit2 == block // 2
    assert root1 == root2 == profile.root_unit_params  # the root trains whole
    assert trained1 == profile.total_params
    assert trained2 == profile.trainable_params == profile.total_params - block
    # the kept unsharded gradients under no_sync: the reduce dtype, over what trains
    assert policy_of(two).accumulated_gradient_bytes(profile, two) == trained2 * 4
    assert policy_of(one).accumulated_gradient_bytes(profile, one) == trained1 * 2


def test_each_sharding_strategy_is_one_row_of_what_it_does() -> None:
    rows = {
        s.value: (t.shards_params, t.reshards, t.replicates, t.keeps_gathered)
        for s, t in engine.SHARDING_TRAITS.items()
    }
    assert rows == {
        "FULL_SHARD": (True, True, False, False),
        "SHARD_GRAD_OP": (True, False, False, True),  # ZeRO-2: gathered into backward
        "NO_SHARD": (False, False, True, False),
        "HYBRID_SHARD": (True, True, True, False),
    }
    # the names each stack takes, and when the space proposes it
    outputs = {
        s.value: (t.fsdp1_name, t.accelerate_name, t.hf_trainer_name, t.needs_mesh)
        for s, t in engine.SHARDING_TRAITS.items()
    }
    assert outputs == {
        "FULL_SHARD": ("FULL_SHARD", "FULL_SHARD", "full_shard", False),
        "SHARD_GRAD_OP": ("SHARD_GRAD_OP", "SHARD_GRAD_OP", "shard_grad_op", False),
        "NO_SHARD": ("NO_SHARD", "NO_SHARD", "no_shard", False),
        "HYBRID_SHARD": ("HYBRID_SHARD", "HYBRID_SHARD", "hybrid_shard", True),
    }
    proposed = {
        s.value: (t.min_ranks, t.min_nodes, t.offloads) for s, t in engine.SHARDING_TRAITS.items()
    }
    assert proposed == {
        "FULL_SHARD": (1, 1, True),
        "SHARD_GRAD_OP": (1, 1, False),
        "NO_SHARD": (2, 1, False),
        "HYBRID_SHARD": (1, 2, False),
    }
    assert set(engine.SHARDING_TRAITS) == set(Sharding)  # every strategy described
    # the mesh each engine shards over: FSDP1 takes the default group unless hybrid
    world = 8
    shapes = {
        (e, s.value): policy_of(c).mesh_shape(c, world)
        for e in ("fsdp1", "fsdp2")
        for s in Sharding
        for c in [fsdp(e, sharding=s, hybrid_mesh=(2, 4) if s.value == "HYBRID_SHARD" else None)]
    }
    assert shapes == {
        ("fsdp1", "FULL_SHARD"): None,
        ("fsdp1", "SHARD_GRAD_OP"): None,
        ("fsdp1", "NO_SHARD"): None,
        ("fsdp1", "HYBRID_SHARD"): (2, 4),
        ("fsdp2", "FULL_SHARD"): (8,),
        ("fsdp2", "SHARD_GRAD_OP"): (8,),
        ("fsdp2", "NO_SHARD"): (8, 1),  # pure replication: a shard dimension of 1
        ("fsdp2", "HYBRID_SHARD"): (2, 4),
    }
    # fully_shard keeps SHARD_GRAD_OP's units gathered whatever the reshard policy
    assert not engine.reshard_after_forward(fsdp("fsdp2", sharding="SHARD_GRAD_OP"))
    assert engine.reshard_after_forward(fsdp("fsdp2", sharding="NO_SHARD"))
