"""The search space (autoshard.space): which configurations are proposed for a model on some
hardware, why each wraps as it does, and the one order every door ranks them in. Quick: the
model is analysed on the meta device, nothing is estimated or run."""

from __future__ import annotations

from collections import Counter

import pytest

from autoshard import Hardware, TargetSpec, WorkloadSpec, analyze_target
from autoshard.config import Candidate, Checkpointing, Engine, Precision, Reshard, Sharding
from autoshard.results import ModelProfile
from autoshard.space import (
    PREDICTED_TIE,
    Knobs,
    default_precisions,
    enumerate_candidates,
    float8_blocker,
    predicted_tie,
    reshards_for,
    shardings_for,
    wrap_reason,
)

GIB = 2**30
ONE_NODE = Hardware(gpus_per_node=8, gpu_memory=80 * GIB, gpu="h100-sxm")
TWO_NODES = ONE_NODE.model_copy(update={"nodes": 2})
WORKLOAD = WorkloadSpec(seq_len=128)


def _profile(n_layer: int = 4) -> ModelProfile:
    spec = TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny", "n_layer": n_layer})
    return analyze_target(spec)[0]


@pytest.fixture(scope="module")
def gpt() -> ModelProfile:
    return _profile()


def _space(profile: ModelProfile, hardware: Hardware = ONE_NODE, **kwargs) -> list[Candidate]:
    kwargs = {"precisions": ("bf16-mixed",), "micro_batch_sizes": (1,)} | kwargs
    return enumerate_candidates(profile, hardware, WORKLOAD, Knobs(**kwargs))


def test_checkpointing_every_second_block_is_proposed_from_four_blocks_on(gpt) -> None:
    assert gpt.block_count == 4
    kinds = {(c.checkpointing, c.checkpoint_every) for c in _space(gpt)}
    assert kinds == {
        (Checkpointing.NONE, 1),
        (Checkpointing.EVERY_K, 2),
        (Checkpointing.SELECTIVE, 1),
        (Checkpointing.ALL, 1),
    }
    three = {(c.checkpointing, c.checkpoint_every) for c in _space(_profile(3))}
    assert three == {(Checkpointing.NONE, 1), (Checkpointing.SELECTIVE, 1), (Checkpointing.ALL, 1)}
    # what is checkpointed is the blocks, and only where something is
    for c in _space(gpt):
        expected = () if c.checkpointing is Checkpointing.NONE else ("gpt.Block",)
        assert c.checkpoint_classes == expected


def test_fsdp1_space_on_one_node_by_hand(gpt) -> None:
    space = _space(gpt, precisions=("bf16-mixed", "32-true"), micro_batch_sizes=(1, 4))
    # per precision and micro-batch: block units x (3 shardings x 4 checkpointings + offload
    # with FULL_SHARD x 4 checkpointings) + the whole model as one unit x 3 shardings
    assert len(space) == 2 * 2 * (3 * 4 + 4 + 3)
    offloading = [c for c in space if c.cpu_offload]
    assert len(offloading) == 2 * 2 * 4
    assert {c.sharding for c in offloading} == {Sharding.FULL_SHARD}
    whole = [c for c in space if not c.wrap_classes]
    assert {(c.sharding, c.checkpointing, c.cpu_offload) for c in whole} == {
        (s, Checkpointing.NONE, False)
        for s in (Sharding.FULL_SHARD, Sharding.SHARD_GRAD_OP, Sharding.NO_SHARD)
    }
    assert Counter((c.precision, c.micro_batch_size) for c in space) == {
        (p, m): 19 for p in (Precision.BF16_MIXED, Precision.FP32) for m in (1, 4)
    }
    assert all(c.engine is Engine.FSDP1 and c.reshard is Reshard.ALL for c in space)
    assert not any(c.compile or c.float8 for c in space)


def test_offload_pinned_on_or_off(gpt) -> None:
    assert not any(c.cpu_offload for c in _space(gpt, offload=False))
    pinned = [c for c in _space(gpt, offload=True) if c.wrap_classes]
    assert pinned and all(c.cpu_offload for c in pinned)


def test_the_knobs_narrow_the_space_to_what_they_name(gpt) -> None:
    default = enumerate_candidates(gpt, ONE_NODE, WORKLOAD)
    assert {c.precision for c in default} == set(default_precisions(ONE_NODE))
    assert {c.micro_batch_size for c in default} == {WORKLOAD.micro_batch_size}
    pinned = enumerate_candidates(
        gpt, ONE_NODE, WORKLOAD, Knobs(precisions=("32-true",), micro_batch_sizes=[2, 8])
    )
    assert {c.precision for c in pinned} == {Precision.FP32}
    assert {c.micro_batch_size for c in pinned} == {2, 8}
    assert len(pinned) == len(default) // len(default_precisions(ONE_NODE)) * 2
    with pytest.raises(ValueError, match="precisions"):
        Knobs(precisions=("fp7",))
    with pytest.raises(ValueError, match="extra"):
        Knobs(sharding="FULL_SHARD")  # not a knob: the space enumerates it


def test_the_optimizer_is_every_candidates_in_its_first_implementation(gpt) -> None:
    # a setting of the workload, not a dimension: the space is as large with any of them
    adamw, adafactor = _space(gpt), _space(gpt, optimizer="adafactor")
    assert len(adafactor) == len(adamw)
    assert {(c.optimizer.value, c.optimizer_impl.value) for c in adafactor} == {
        ("adafactor", "foreach")
    }
    assert [c.model_copy(update={"optimizer": "adamw"}) for c in adafactor] == adamw


def test_fsdp2_reshard_policies_where_they_differ(gpt) -> None:
    space = _space(gpt, TWO_NODES, engine="fsdp2")
    policies: dict[tuple, set[Reshard]] = {}
    for c in space:
        key = (c.sharding, bool(c.wrap_classes), c.cpu_offload)
        policies.setdefault(key, set()).add(c.reshard)
    every = set(Reshard)
    assert policies[(Sharding.FULL_SHARD, True, False)] == every
    assert policies[(Sharding.HYBRID_SHARD, True, False)] == every
    assert policies[(Sharding.FULL_SHARD, True, True)] == {Reshard.ALL}  # offload: last resort
    assert policies[(Sharding.SHARD_GRAD_OP, True, False)] == {Reshard.ALL}
    assert policies[(Sharding.FULL_SHARD, False, False)] == {Reshard.ALL}  # one unit
    assert {c.hybrid_mesh for c in space if c.sharding is Sharding.HYBRID_SHARD} == {(2, 8)}
    # pinned reshard policies replace the three, where there are three
    pinned = _space(gpt, engine="fsdp2", reshards=("keep_root",))
    assert {c.reshard for c in pinned if c.wrap_classes and not c.cpu_offload
            and c.sharding is Sharding.FULL_SHARD} == {Reshard.KEEP_ROOT}  # fmt: skip
    assert reshards_for(Engine.FSDP2, Sharding.FULL_SHARD, wrapped=True, offload=False) == tuple(
        Reshard
    )
    assert reshards_for("fsdp1", Sharding.FULL_SHARD, wrapped=True, offload=False) == (Reshard.ALL,)
    assert reshards_for("fsdp2", Sharding.FULL_SHARD, wrapped=False, offload=False) == (
        Reshard.ALL,
    )


def test_compile_and_float8_double_the_space_where_they_go(gpt) -> None:
    plain = _space(gpt, engine="fsdp2", precisions=("bf16-mixed", "32-true"))
    both = _space(gpt, engine="fsdp2", precisions=("bf16-mixed", "32-true"),
                  compiles=(False, True), float8s=(False, True))  # fmt: skip
    switched = Counter((c.compile, c.float8) for c in both)
    bf16 = sum(c.precision is Precision.BF16_MIXED for c in plain)
    # float8 only with bf16 compute; compile with every precision
    assert switched == {
        (False, False): len(plain),
        (True, False): len(plain),
        (False, True): bf16,
        (True, True): bf16,
    }
    assert all(c.precision is Precision.BF16_MIXED for c in both if c.float8)
    # FSDP1 has no float8 all-gather: none proposed
    fsdp1 = _space(gpt, float8s=(False, True))
    assert not any(c.float8 for c in fsdp1) and len(fsdp1) == len(_space(gpt))


def test_shardings_and_precisions_for_the_hardware() -> None:
    one = ONE_NODE.model_copy(update={"gpus_per_node": 1})
    assert shardings_for(one) == [(Sharding.FULL_SHARD, None)]
    assert shardings_for(one, Engine.FSDP2) == [
        (Sharding.FULL_SHARD, None), (Sharding.SHARD_GRAD_OP, None)]  # fmt: skip
    assert [s for s, _ in shardings_for(ONE_NODE)] == [
        Sharding.FULL_SHARD, Sharding.SHARD_GRAD_OP, Sharding.NO_SHARD]  # fmt: skip
    assert shardings_for(TWO_NODES)[-1] == (Sharding.HYBRID_SHARD, (2, 8))
    assert default_precisions(ONE_NODE) == (Precision.BF16_MIXED, Precision.FP32)
    no_bf16 = ONE_NODE.model_copy(update={"bf16_supported": False})
    assert default_precisions(no_bf16) == (Precision.FP16_MIXED, Precision.FP32)


def test_why_float8_cannot_be_planned_word_for_word() -> None:
    fp8 = "b200, h100-pcie, h100-sxm, h200, h200-nvl, l4, l40s, mi300x"
    assert float8_blocker(ONE_NODE, "fsdp1") == (
        "FSDP1 has no float8 all-gather (torchao's float8 weights hook into FSDP2's "
        "fully_shard): use engine fsdp2"
    )
    cpu = Hardware(gpus_per_node=2, gpu_memory=GIB, gpu="cpu-gloo", backend="gloo")
    assert float8_blocker(cpu, "fsdp2") == "CPU processes have no fp8 tensor cores"
    unknown = ONE_NODE.model_copy(update={"gpu": None})
    assert float8_blocker(unknown, "fsdp2") == (
        f"the GPU model is not known: give gpu (--gpu) as one of {fp8}"
    )
    a100 = ONE_NODE.model_copy(update={"gpu": "a100-80gb-sxm"})
    assert (
        float8_blocker(a100, "fsdp2")
        == f"NVIDIA A100 SXM4 80GB has no fp8 tensor cores (fp8: {fp8})"
    )
    no_bf16 = ONE_NODE.model_copy(update={"bf16_supported": False})
    assert float8_blocker(no_bf16, "fsdp2") == (
        "these GPUs do not compute in bf16, which float8 training needs"
    )
    assert float8_blocker(ONE_NODE, Engine.FSDP2) is None


def test_each_wrap_is_explained_word_for_word(gpt) -> None:
    why = gpt.wrap_reason
    blocks = Candidate(wrap_classes=("gpt.Block",))
    assert wrap_reason(blocks, gpt) == f"auto_wrap_policy {{gpt.Block}}: {why}"
    by_size = Candidate(min_num_params=100_000)
    assert wrap_reason(by_size, gpt) == f"auto_wrap_policy min_num_params=100,000: {why}"
    assert wrap_reason(Candidate(), gpt) == (
        "no auto_wrap_policy (Lightning's default): the whole model is one FSDP unit, gathered "
        "at once; the fewest collectives, and it fits"
    )
    fsdp2 = Candidate(engine="fsdp2", wrap_classes=("gpt.Block", "gpt.Head"))
    assert (
        wrap_reason(fsdp2, gpt)
        == f"fully_shard on each {{gpt.Block, gpt.Head}}, then the root: {why}"
    )
    assert wrap_reason(Candidate(engine="fsdp2"), gpt) == (
        "fully_shard on the root only: the whole model is one FSDP unit, gathered at once; "
        "the fewest collectives, and it fits"
    )


def test_a_predicted_tie_is_within_five_percent_of_the_fastest() -> None:
    assert PREDICTED_TIE == 0.05
    assert predicted_tie(95.0, 100.0)  # exactly 5% slower: still a tie
    assert not predicted_tie(94.9, 100.0)
    # what a tie decides is the decision's rule: tests/test_ranking.py
