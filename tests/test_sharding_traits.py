"""A sharding strategy is one row of ``config.SHARDING_TRAITS``: the estimators, the simulation's
and the trials' set-up, the space and every emitter read the row, so a new strategy is an enum
member and its row. Checked with a row that no strategy has today, torch's ZeRO-2 on a hybrid
mesh (``ShardingStrategy._HYBRID_SHARD_ZERO2``), put in FULL_SHARD's place: nothing else
changes, and every consumer does what torch, Lightning and accelerate do with it."""

from __future__ import annotations

import ast
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from autoshard import emit, engine, sharding
from autoshard.analyze import analyze_target
from autoshard.config import (
    SHARDING_TRAITS,
    Candidate,
    Engine,
    Hardware,
    Reshard,
    ShardGroup,
    Sharding,
    ShardingTraits,
    WorkloadSpec,
)
from autoshard.emit.prose import describe_reshard
from autoshard.emit.text import accelerate_config, hf_trainer_config, lightning_cli_config
from autoshard.predict.activations import precisions_of, profile_activations
from autoshard.predict.analytic import estimate_memory
from autoshard.predict.simulate import simulate_memory
from autoshard.recommendation import Recommendation
from autoshard.results import Scored
from autoshard.space import reshards_for, shardings_for
from autoshard.target.resolve import TargetSpec

from .conftest import EXAMPLES
from .test_emit import PROFILE, WORKLOAD, estimate, load_like_accelerate

PACKAGE = Path(__file__).resolve().parents[1] / "autoshard"
GIB = 2**30
TWO_NODES = Hardware(gpus_per_node=2, nodes=2, gpu_memory=80 * GIB)
ZERO2 = ShardingTraits(
    ShardGroup.HYBRID,
    reshards=False,
    fsdp1_name="_HYBRID_SHARD_ZERO2",
    accelerate_name="HYBRID_SHARD_ZERO2",
    min_nodes=2,
)


@pytest.fixture
def zero2(monkeypatch: pytest.MonkeyPatch) -> Sharding:
    """FULL_SHARD's row replaced by the ZeRO-2 hybrid row: the member whose row it now is."""
    monkeypatch.setitem(SHARDING_TRAITS, Sharding.FULL_SHARD, ZERO2)
    return Sharding.FULL_SHARD


def zero2_candidate(member: Sharding, **update: Any) -> Candidate:
    return Candidate(
        **{"sharding": member, "hybrid_mesh": (2, 2), "wrap_classes": ("gpt.Block",), **update}
    )


def test_a_new_row_is_validated_planned_and_proposed(zero2: Sharding) -> None:
    with pytest.raises(ValueError, match="FULL_SHARD needs hybrid_mesh"):
        Candidate(sharding=zero2)
    for name in ("fsdp1", "fsdp2"):
        c = zero2_candidate(zero2, engine=name)
        assert engine.shard_group(c, TWO_NODES) == (2, 2)  # (shard, replicas)
        assert engine.policy_of(c).mesh_shape(c, 4) == (2, 2)
        # ZeRO-2: kept gathered from forward into backward, whatever the reshard policy
        assert not engine.reshard_after_forward(c)
        assert not engine.policy_of(c).regathers(c)
    one_node = TWO_NODES.model_copy(update={"nodes": 1})
    assert zero2 not in [s for s, _ in shardings_for(one_node, Engine.FSDP2)]
    assert (zero2, (2, 2)) in shardings_for(TWO_NODES, Engine.FSDP2)
    # the space offers no reshard policies for a strategy that keeps units gathered
    assert reshards_for(Engine.FSDP2, zero2, wrapped=True, offload=False) == (Reshard.ALL,)


def rec_of(c: Candidate) -> Recommendation:
    return Recommendation(
        profile=PROFILE,
        hardware=TWO_NODES,
        workload=WORKLOAD,
        chosen=Scored(candidate=c, estimate=estimate(c)),
        basis="estimate",
        reasons=("the fastest predicted",),
        created_at=datetime(2026, 11, 24, tzinfo=timezone.utc),
        versions={"autoshard": "0.1.0", "torch": "2.13.0"},
    )


def test_a_new_row_reaches_every_fsdp1_output(
    zero2: Sharding, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.fsdp import ShardingStrategy

    monkeypatch.syspath_prepend(str(EXAMPLES))
    c = zero2_candidate(zero2, engine="fsdp1")
    rec = rec_of(c)
    # the trials' FullyShardedDataParallel arguments
    assert sharding.fsdp1_kwargs(c)["sharding_strategy"] is ShardingStrategy._HYBRID_SHARD_ZERO2
    # Lightning's FSDPStrategy, built, and its CLI YAML
    strategy = emit.strategy(rec)
    assert strategy.sharding_strategy is ShardingStrategy._HYBRID_SHARD_ZERO2
    init = lightning_cli_config(rec)["trainer"]["strategy"]["init_args"]
    assert (init["sharding_strategy"], init["device_mesh"]) == ("_HYBRID_SHARD_ZERO2", [2, 2])
    # accelerate's FSDP plugin, loaded from the YAML as its launcher does
    _, plugin = load_like_accelerate(tmp_path, rec.to_yaml("accelerate"), monkeypatch)
    assert plugin.sharding_strategy is ShardingStrategy._HYBRID_SHARD_ZERO2
    # the HF Trainer hands its fsdp_config to the same plugin
    fsdp, notes = hf_trainer_config(rec)
    assert fsdp["fsdp_config"]["reshard_after_forward"] == "hybrid_shard_zero2"
    assert (
        notes[0] == "FULL_SHARD shards within each node (2 ranks), as the Hugging Face Trainer does"
    )


def test_a_new_row_reaches_every_fsdp2_output(zero2: Sharding) -> None:
    c = zero2_candidate(zero2, engine="fsdp2")
    rec = rec_of(c)
    config, _ = accelerate_config(rec)
    assert config["fsdp_config"]["fsdp_reshard_after_forward"] is False
    assert config["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": 2,
    }
    fsdp, notes = hf_trainer_config(rec)
    assert fsdp["fsdp_config"]["reshard_after_forward"] is False
    assert notes[0].startswith("FULL_SHARD: pass parallelism_config=")
    assert describe_reshard(c) == (
        "nothing reshards after forward (FULL_SHARD: reshard_after_forward=False)"
    )


def test_a_new_row_is_estimated_as_torch_runs_it(zero2: Sharding) -> None:
    """The simulation runs torch's own code for the row (FSDP1 ``_HYBRID_SHARD_ZERO2``; FSDP2
    ``reshard_after_forward=False`` on the (2, 2) mesh); the analytic estimate, which has no
    line for it, lands within 1% (measured: 0.05-0.19%) and keeps the whole model gathered."""
    target = TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"})
    profile, built = analyze_target(target)
    workload = WorkloadSpec(seq_len=128)
    for name in ("fsdp1", "fsdp2"):
        c = zero2_candidate(zero2, engine=name, wrap_classes=profile.wrap_policy)
        acts = profile_activations(built.model, profile, workload, precisions=precisions_of([c]))
        sim = simulate_memory(target, c, TWO_NODES, workload, block_classes=profile.block_classes)
        ana = estimate_memory(profile, c, TWO_NODES, workload, activations=acts)
        measured = sim.gpu_peak - sim.breakdown.allowance
        predicted = ana.gpu_peak - ana.breakdown.allowance
        assert abs(predicted - measured) <= 0.01 * measured, (name, predicted, measured)
        gathered = profile.total_params * 2  # bf16
        assert sim.breakdown.unsharded_params == ana.breakdown.unsharded_params == gathered
        assert ana.breakdown.sharded_params == profile.total_params * 4 // 2  # shard group of 2


class _Names(ast.NodeVisitor):
    """Where a module names a strategy (``Sharding.X``, or one of the rows' names as a string),
    by the function that does."""

    def __init__(self, names: set[str], strings: set[str]) -> None:
        self.names, self.strings = names, strings
        self.where: list[str] = ["<module>"]
        self.found: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.where.append(node.name)
        self.generic_visit(node)
        self.where.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        sharding = isinstance(node.value, ast.Name) and node.value.id == "Sharding"
        if sharding and node.attr in self.names:
            self.found.append(f"{self.where[-1]}: Sharding.{node.attr}")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if node.value in self.strings:
            self.found.append(f"{self.where[-1]}: {node.value!r}")


def test_no_module_names_a_sharding_strategy_but_its_row() -> None:
    """Outside ``config.py`` (the enum and its rows) no code names a strategy, as
    ``Sharding.X`` or as a string: a new strategy has nothing else to change. The one exception
    is an engine fact, not a strategy's: FSDP1 runs every strategy as NO_SHARD on one rank."""
    rows = SHARDING_TRAITS.values()
    strings = {s.value for s in Sharding} | {t.fsdp1_name for t in rows}
    strings |= {t.accelerate_name for t in rows} | {t.hf_trainer_name for t in rows}
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "config.py":
            continue
        names = _Names({s.name for s in Sharding}, strings)
        names.visit(ast.parse(path.read_text()))
        if names.found:
            found[str(path.relative_to(PACKAGE))] = names.found
    assert found == {"engine.py": ["as_run: Sharding.NO_SHARD"] * 2}, found


def test_torch_lightning_and_accelerate_take_every_rows_names() -> None:
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY
    from lightning.fabric.strategies.fsdp import _init_sharding_strategy
    from torch.distributed.fsdp import ShardingStrategy

    for row in [*SHARDING_TRAITS.values(), ZERO2]:
        torch_strategy = ShardingStrategy[row.fsdp1_name]
        assert _init_sharding_strategy(row.fsdp1_name, {"device_mesh": (1, 1)}) is torch_strategy
        # accelerate numbers its names as torch numbers the strategies (utils/dataclasses.py)
        position = FSDP_SHARDING_STRATEGY.index(row.accelerate_name) + 1
        assert ShardingStrategy(position) is torch_strategy, row
