"""emit: the strategy object, and the Lightning CLI / accelerate YAML read back by their own
parsers (jsonargparse as LightningCLI drives it; accelerate's launcher and FSDP plugin)."""

from __future__ import annotations

import inspect
import pickle
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from autoshard import emit
from autoshard.config import (
    BackwardPrefetch,
    Candidate,
    Checkpointing,
    Engine,
    Hardware,
    Precision,
    Sharding,
    WorkloadSpec,
)
from autoshard.errors import ConfigError, MissingDependencyError
from autoshard.recommendation import Recommendation
from autoshard.results import (
    Decision,
    MemoryBreakdown,
    MemoryEstimate,
    ModelProfile,
    Scored,
    TrialResult,
    TrialStatus,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GiB = 2**30

# ---------------------------------------------------------------------------------------------
# Fixtures: Recommendation objects built directly (a profile of examples/gpt.py, class gpt.Block)
# ---------------------------------------------------------------------------------------------

PROFILE = ModelProfile(
    target="examples/gpt.py:build size='tiny'",
    model_class="gpt.GPT",
    total_params=1_872_640,
    trainable_params=1_872_640,
    param_bytes=7_490_560,
    block_classes=("gpt.Block",),
    block_count=4,
    block_params=197_760,
    wrap_policy=("gpt.Block",),
    checkpoint_policy=("gpt.Block",),
    vocab_size=4096,
)
HARDWARE = Hardware(gpus_per_node=2, nodes=1, gpu_memory=2 * GiB)
WORKLOAD = WorkloadSpec(micro_batch_size=2, seq_len=128)
WHEN = datetime(2026, 11, 22, 12, 46, tzinfo=timezone.utc)


def candidate(**update: Any) -> Candidate:
    base: dict[str, Any] = {"wrap_classes": ("gpt.Block",), "micro_batch_size": 2}
    if update.get("checkpointing", Checkpointing.NONE) is not Checkpointing.NONE:
        base["checkpoint_classes"] = ("gpt.Block",)
    return Candidate(**{**base, **update})


def estimate(c: Candidate, scale: float = 1.0, limit: int = 2 * GiB) -> MemoryEstimate:
    b = MemoryBreakdown(
        sharded_params=int(3.7e6 * scale),
        unsharded_params=int(5.9e6 * scale),
        gradients=int(3.7e6 * scale),
        optimizer=int(7.5e6 * scale),
        comm_buffers=int(1.6e6 * scale),
        activations=int(60e6 * scale * c.micro_batch_size),
        temporaries=int(10e6 * scale),
        allowance=int(900e6),
    )
    usable = int(limit * 0.95)
    return MemoryEstimate(
        candidate=c,
        method="analytic",
        gpu_peak=b.total,
        breakdown=b,
        fits=b.total <= usable,
        headroom=usable - b.total,
        reason="" if b.total <= usable else "needs more than the usable GPU memory",
    )


def trial(c: Candidate, step: float, status: TrialStatus = TrialStatus.OK) -> TrialResult:
    ok = status is TrialStatus.OK
    return TrialResult(
        candidate=c,
        status=status,
        world_size=2,
        step_time=step if ok else None,
        step_times=(step, step * 1.02, step * 0.99) if ok else (),
        samples_per_s=2 * c.micro_batch_size / step if ok else None,
        tokens_per_s=2 * c.micro_batch_size * 128 / step if ok else None,
        peak_allocated=(int(70e6 * step * 4), int(60e6 * step * 4)) if ok else (),
        peak_reserved=(int(400e6), int(390e6)) if ok else (),
        losses=(8.3, 8.2, 8.1) if ok else (),
        error=None if ok else "CUDA out of memory (capped at 2 GiB)",
        started_at=WHEN,
    )


def make_rec(
    chosen: Candidate | None = None, *, basis: str = "trials", **rec: Any
) -> Recommendation:
    chosen = chosen or candidate()
    others = [
        candidate(sharding=Sharding.SHARD_GRAD_OP),
        candidate(sharding=Sharding.NO_SHARD),
        candidate(micro_batch_size=1),
    ]
    oom = candidate(micro_batch_size=8, checkpointing=Checkpointing.ALL)
    pruned = candidate(micro_batch_size=32)
    tried = basis == "trials"
    return Recommendation(
        profile=rec.pop("profile", PROFILE),
        hardware=rec.pop("hardware", HARDWARE),
        workload=WORKLOAD,
        chosen=Scored(
            candidate=chosen,
            estimate=estimate(chosen),
            trial=trial(chosen, 0.228) if tried else None,
        ),
        runners_up=tuple(
            Scored(
                candidate=c,
                estimate=estimate(c),
                trial=trial(c, 0.26 + 0.03 * i) if tried else None,
            )
            for i, c in enumerate(others)
        ),
        ruled_out=(
            Scored(
                candidate=oom,
                estimate=estimate(oom),
                trial=trial(oom, 0, TrialStatus.OOM) if tried else None,
            ),
            Scored(candidate=pruned, estimate=estimate(pruned)),
        ),
        basis=basis,  # type: ignore[arg-type]
        reasons=(
            "fastest of 4 measured configurations",
            "auto_wrap_policy {gpt.Block}: repeated blocks",
        ),
        created_at=WHEN,
        versions={"autoshard": "0.1.0", "torch": "2.13.0"},
        **rec,
    )


def all_trials(rec: Recommendation) -> list[TrialResult]:
    return [s.trial for s in (rec.chosen, *rec.runners_up, *rec.ruled_out) if s.trial is not None]


@pytest.fixture
def gpt_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Class paths say ``gpt.Block``: the model's folder must be importable, as for the user."""
    monkeypatch.syspath_prepend(str(EXAMPLES))


FSDP1_CASES = {
    "full-bf16-ckpt": candidate(precision=Precision.BF16_MIXED, checkpointing=Checkpointing.ALL),
    "hybrid-every2-fp32": candidate(
        sharding=Sharding.HYBRID_SHARD,
        hybrid_mesh=(2, 1),
        precision=Precision.FP32,
        checkpointing=Checkpointing.EVERY_K,
        checkpoint_every=2,
        backward_prefetch=BackwardPrefetch.NONE,
        limit_all_gathers=False,
        forward_prefetch=True,
    ),
    "gradop-16-offload": candidate(
        sharding=Sharding.SHARD_GRAD_OP, precision=Precision.FP16_MIXED, cpu_offload=True
    ),
}

# ---------------------------------------------------------------------------------------------
# The strategy object
# ---------------------------------------------------------------------------------------------


def strategy_settings(s: Any) -> dict[str, Any]:
    """Every setting autoshard chooses, read back from a constructed FSDPStrategy."""
    kwargs = dict(s.kwargs)
    wrap = kwargs.pop("auto_wrap_policy", None)
    ckpt = s._activation_checkpointing_kwargs.get("auto_wrap_policy")
    return {
        "sharding_strategy": s.sharding_strategy,
        "cpu_offload": s.cpu_offload,
        "mixed_precision": s.mixed_precision,
        "state_dict_type": s._state_dict_type,
        "wrap": (type(wrap), frozenset(wrap._module_classes)) if wrap else None,
        "ckpt": (type(ckpt), frozenset(ckpt._module_classes), getattr(ckpt, "every", 1))
        if ckpt
        else None,
        "kwargs": kwargs,
    }


@pytest.mark.usefixtures("gpt_importable")
@pytest.mark.parametrize("case", list(FSDP1_CASES))
def test_strategy_has_every_chosen_setting(case: str) -> None:
    import gpt
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    c = FSDP1_CASES[case]
    rec = make_rec(c)
    got = strategy_settings(rec.strategy())
    assert got["sharding_strategy"] is ShardingStrategy[c.sharding.value]
    assert got["cpu_offload"] == CPUOffload(offload_params=c.cpu_offload)
    assert got["wrap"][1] == {gpt.Block}
    assert got["kwargs"]["limit_all_gathers"] is c.limit_all_gathers
    assert got["kwargs"]["forward_prefetch"] is c.forward_prefetch
    assert got["kwargs"]["use_orig_params"] is True
    expected_prefetch = (
        None if c.backward_prefetch is BackwardPrefetch.NONE else TorchPrefetch.BACKWARD_PRE
    )
    fsdp_default = inspect.signature(FSDP).parameters["backward_prefetch"].default
    assert got["kwargs"].get("backward_prefetch", fsdp_default) is expected_prefetch
    assert got["kwargs"].get("device_mesh") == c.hybrid_mesh
    assert got["state_dict_type"] == "full"
    if c.checkpointing is Checkpointing.NONE:
        assert got["ckpt"] is None
    else:
        assert got["ckpt"][1] == {gpt.Block} and got["ckpt"][2] == c.checkpoint_every
    # The Trainer's precision expresses the mixed precision the trials ran with, so none is set.
    assert got["mixed_precision"] is None
    assert rec.trainer_kwargs() == {"precision": c.precision.value, "devices": 2, "num_nodes": 1}


def test_trainer_precision_gives_the_mixed_precision_trials_used() -> None:
    """Leaving mixed_precision to the Trainer is only right if Lightning's plugin makes the very
    MixedPrecision that sharding.fsdp1_kwargs (the trials) used."""
    from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision

    from autoshard.sharding import fsdp1_kwargs

    for p in Precision:
        ours = fsdp1_kwargs(candidate(precision=p, wrap_classes=()))["mixed_precision"]
        assert FSDPPrecision(p.value).mixed_precision_config == ours, p  # type: ignore[arg-type]


def test_every_kth_policy_picks_the_blocks_sharding_checkpoints(gpt_importable: None) -> None:
    import gpt
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from autoshard.sharding import apply_checkpointing

    model = gpt.build("tiny", n_layer=5)
    blocks = [m for m in model.modules() if isinstance(m, gpt.Block)]
    picked = emit.EveryKthPolicy([gpt.Block], every=2)._run_policy(model, set(), {})
    assert [blocks.index(m) for m in picked] == list(range(0, len(blocks), 2))
    apply_checkpointing(model, candidate(checkpointing=Checkpointing.EVERY_K, checkpoint_every=2))
    wrapped = [
        m._checkpoint_wrapped_module for m in model.modules() if isinstance(m, CheckpointWrapper)
    ]
    assert set(map(id, wrapped)) == set(map(id, picked))


def test_state_dict_type_is_sharded_for_big_models() -> None:
    big = PROFILE.model_copy(update={"total_params": 7_000_000_000})
    kind, why = emit.choose_state_dict_type(make_rec(profile=big))
    assert kind == "sharded" and "rank 0" in why
    assert emit.choose_state_dict_type(make_rec())[0] == "full"


def test_fsdp2_strategy_and_plan_arguments() -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    rec = make_rec(candidate(engine=Engine.FSDP2, sharding=Sharding.SHARD_GRAD_OP))
    s = rec.strategy()
    assert isinstance(s, ModelParallelStrategy)
    assert (s._data_parallel_size, s._tensor_parallel_size) == (2, 1)
    assert callable(rec.fsdp2_plan())
    with pytest.raises(ConfigError, match="FSDP2"):
        rec.fsdp_kwargs()
    with pytest.raises(ConfigError, match="FSDP1"):
        make_rec().fsdp2_plan()


def test_missing_lightning_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'autoshard\[lightning\]'"):
        make_rec().strategy()


# ---------------------------------------------------------------------------------------------
# Lightning CLI YAML, parsed the way LightningCLI parses it
# ---------------------------------------------------------------------------------------------


def parse_like_lightning_cli(text: str) -> Any:
    """LightningCLI's own steps: add the Trainer's signature under ``trainer`` (not instantiated),
    parse the config, instantiate the nested classes (the strategy)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(Trainer, "trainer")
    cfg = parser.parse_string(text)
    return parser.instantiate_classes(cfg).trainer


@pytest.mark.usefixtures("gpt_importable")
@pytest.mark.parametrize("case", list(FSDP1_CASES))
def test_lightning_yaml_builds_the_same_strategy(case: str) -> None:
    rec = make_rec(FSDP1_CASES[case])
    text = rec.to_yaml("lightning")
    assert "# measured 2026-11-22 12:46 UTC on 2 cpu ranks: 0.228 s/step" in text
    trainer = parse_like_lightning_cli(text)
    assert type(trainer.strategy) is type(rec.strategy())
    assert strategy_settings(trainer.strategy) == strategy_settings(rec.strategy())
    for key, value in rec.trainer_kwargs().items():
        assert trainer[key] == value


def test_lightning_yaml_fsdp2_builds_model_parallel_strategy() -> None:
    rec = make_rec(candidate(engine=Engine.FSDP2), basis="estimate")
    text = rec.to_yaml("lightning")
    assert "by estimate alone" in text and "fsdp2_plan" in text
    s = parse_like_lightning_cli(text).strategy
    assert type(s).__name__ == "ModelParallelStrategy"
    assert (s._data_parallel_size, s._tensor_parallel_size) == (2, 1)


@pytest.mark.parametrize("reshard", ["all", "keep_root", "keep_root_and_last"])
def test_fsdp2_yaml_says_which_units_reshard(
    reshard: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ModelParallelStrategy's plan is code and accelerate has no key for the root or the last
    block: the YAML comments say the policy and the calls that apply it."""
    rec = make_rec(candidate(engine=Engine.FSDP2, reshard=reshard))
    lightning = rec.to_yaml("lightning")
    assert f"#   (the plan: reshard policy {reshard}:" in lightning
    assert type(parse_like_lightning_cli(lightning).strategy).__name__ == "ModelParallelStrategy"
    # NO_SHARD keeps every unit gathered: the comment says so in a sentence
    kept = make_rec(candidate(engine=Engine.FSDP2, sharding="SHARD_GRAD_OP")).to_yaml("lightning")
    assert "#   (the plan: nothing reshards after forward (SHARD_GRAD_OP: " in kept
    assert "which applies the nothing" not in kept
    text = rec.to_yaml("accelerate")
    assert f"# reshard policy {reshard}:" in text
    keeps_root = "#   model.get_input_embeddings().set_reshard_after_forward(False)" in text
    keeps_last = "#   model.model.layers[-1].set_reshard_after_forward(False)" in text
    assert (keeps_root, keeps_last) == (reshard != "all", reshard == "keep_root_and_last")
    assert ("#   model.set_reshard_after_forward(True)" in text) is (reshard == "all")
    _, plugin = load_like_accelerate(tmp_path, text, monkeypatch)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True


def test_lightning_yaml_refuses_what_it_cannot_express() -> None:
    with pytest.raises(ConfigError, match="BACKWARD_POST"):
        make_rec(candidate(backward_prefetch=BackwardPrefetch.BACKWARD_POST)).to_yaml("lightning")
    with pytest.raises(ConfigError, match="size-based"):
        make_rec(candidate(wrap_classes=(), min_num_params=10_000)).to_yaml("lightning")


# ---------------------------------------------------------------------------------------------
# accelerate YAML, loaded by accelerate's launcher and plugin
# ---------------------------------------------------------------------------------------------


def load_like_accelerate(tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``accelerate launch --config_file``: parse, merge the config file, build the workers'
    environment; then the FSDP plugin a worker's Accelerator builds from that environment."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    args = launch_command_parser().parse_args(
        ["--config_file", str(path), "--main_process_port", "29999", "train.py"]
    )
    _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_")):
            monkeypatch.setenv(key, value)
    # sync_module_states asks for the current GPU; be the GPU machine the YAML is meant for.
    import accelerate.utils.dataclasses as acc_dataclasses
    import torch

    monkeypatch.setattr(acc_dataclasses, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return args, FullyShardedDataParallelPlugin()


@pytest.mark.parametrize("case", ["full-bf16-ckpt", "gradop-16-offload"])
def test_accelerate_yaml_loads_with_accelerates_plugin(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    c = FSDP1_CASES[case]
    args, plugin = load_like_accelerate(tmp_path, make_rec(c).to_yaml("accelerate"), monkeypatch)
    assert args.mixed_precision == {"bf16-mixed": "bf16", "16-mixed": "fp16"}[c.precision.value]
    assert (args.num_processes, args.num_machines) == (2, 1)
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy is ShardingStrategy[c.sharding.value]
    assert plugin.transformer_cls_names_to_wrap == ["Block"]
    assert plugin.backward_prefetch is TorchPrefetch.BACKWARD_PRE
    assert plugin.cpu_offload.offload_params is c.cpu_offload
    assert plugin.activation_checkpointing is (c.checkpointing is not Checkpointing.NONE)
    assert plugin.use_orig_params is True
    assert plugin.state_dict_type is StateDictType.FULL_STATE_DICT


def test_accelerate_yaml_fsdp2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = PROFILE.model_copy(update={"total_params": 7_000_000_000})
    c = candidate(
        engine=Engine.FSDP2, sharding=Sharding.SHARD_GRAD_OP, checkpointing=Checkpointing.ALL
    )
    _, plugin = load_like_accelerate(
        tmp_path, make_rec(c, profile=big).to_yaml("accelerate"), monkeypatch
    )
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is False
    assert plugin.activation_checkpointing is True
    assert plugin.state_dict_type.name == "SHARDED_STATE_DICT"


def test_json_round_trip() -> None:
    rec = make_rec()
    assert Recommendation.model_validate_json(rec.to_yaml("json")) == rec
    with pytest.raises(ConfigError, match="--format"):
        rec.to_yaml("toml")


def test_round_trips_give_back_the_recommendation_with_its_doors() -> None:
    """JSON and pickle give back the user's Recommendation (autoshard.recommendation), methods
    and all; emit takes the bare data, results.Decision, which the methods hand it."""
    rec = make_rec()
    for back in (
        Recommendation.model_validate_json(rec.model_dump_json()),
        pickle.loads(pickle.dumps(rec)),
    ):
        assert type(back) is Recommendation and back == rec
        assert back.trainer_kwargs() == rec.trainer_kwargs()
    data = Decision.model_validate(rec.model_dump())
    assert not hasattr(data, "to_yaml") and data != rec  # another class, the same fields
    assert emit.render(data, "lightning") == rec.to_yaml("lightning")
    assert repr(data).startswith("Decision(") and str(data) == str(rec)


def test_accelerate_yaml_fsdp2_hybrid_shard_keeps_the_mesh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2 nodes of 8 GPUs: replicate across the 2 nodes, shard within each node's 8 (the other
    # way round, accelerate would build an 8 x 8 mesh for 16 processes)
    from accelerate.parallelism_config import ParallelismConfig

    c = candidate(engine=Engine.FSDP2, sharding=Sharding.HYBRID_SHARD, hybrid_mesh=(2, 8))
    rec = make_rec(c, hardware=Hardware(gpus_per_node=8, nodes=2, gpu_memory=80 * GiB))
    args, plugin = load_like_accelerate(tmp_path, rec.to_yaml("accelerate"), monkeypatch)
    assert (args.num_processes, args.num_machines) == (16, 2)
    assert plugin.fsdp_version == 2
    mesh = ParallelismConfig()  # what a worker's Accelerator reads from the launcher's env
    assert (mesh.dp_replicate_size, mesh.dp_shard_size) == (2, 8)
    assert mesh.total_size == 16


def test_fsdp2_strategy_saves_a_distributed_checkpoint_for_big_models() -> None:
    # a 7B model gathered into one full checkpoint on rank 0 needs 28 GB of its host memory at
    # every save: ModelParallelStrategy saves it sharded instead; a small model, as one file
    fsdp2 = candidate(engine=Engine.FSDP2, sharding=Sharding.SHARD_GRAD_OP)
    big = PROFILE.model_copy(update={"total_params": 7_000_000_000})
    for profile, sharded in ((big, True), (PROFILE, False)):
        rec = make_rec(fsdp2, profile=profile)
        assert emit.strategy_kwargs(rec)["save_distributed_checkpoint"] is sharded
        assert rec.strategy()._save_distributed_checkpoint is sharded
        from_yaml = parse_like_lightning_cli(rec.to_yaml("lightning")).strategy
        assert from_yaml._save_distributed_checkpoint is sharded


def test_strategy_keeps_a_size_based_wrap_policy() -> None:
    # no block class: FSDP1 wraps by size; the Lightning strategy must carry that policy
    c = candidate(wrap_classes=(), min_num_params=100_000)
    policy = emit.strategy_kwargs(make_rec(c))["auto_wrap_policy"]
    assert policy.func.__name__ == "size_based_auto_wrap_policy"
    assert policy.keywords == {"min_num_params": 100_000}


def test_exports_name_the_autoshard_version_that_chose() -> None:
    rec = make_rec()
    for fmt in ("lightning", "accelerate"):
        assert rec.to_yaml(fmt).startswith(f"# autoshard 0.1.0: {rec.chosen.candidate.label()}\n")


# (mutation survivors of autoshard.emit, scripts/mutation.sh emit)


def test_accelerate_notes_name_accelerate_and_cli_yaml_refuses_a_size_policy() -> None:
    from autoshard.emit.text import accelerate_config, lightning_cli_config

    hybrid = candidate(sharding=Sharding.HYBRID_SHARD, hybrid_mesh=(2, 1), compile=True)
    _, notes = accelerate_config(make_rec(hybrid))
    assert (
        "accelerate's HYBRID_SHARD shards within each node (2 ranks); autoshard chose groups of 1 "
        "(mesh 2 x 1), which accelerate has no setting for: rec.apply(model) applies it"
    ) in notes
    fsdp2 = candidate(engine=Engine.FSDP2, compile=True)
    _, notes = accelerate_config(make_rec(fsdp2))
    assert any(n.endswith("; accelerate's own compile flag compiles it whole") for n in notes)
    with pytest.raises(ConfigError) as refused:
        lightning_cli_config(make_rec(candidate(wrap_classes=(), min_num_params=100_000)))
    assert str(refused.value) == (
        "a size-based wrap policy cannot be written as Lightning CLI YAML; use rec.strategy() in "
        "code"
    )


def test_hf_trainer_arguments_carry_the_hybrid_mesh_note_and_the_evidence() -> None:
    from autoshard.emit.prose import describe_evidence
    from autoshard.emit.text import hf_trainer_config

    rec = make_rec(
        candidate(engine=Engine.FSDP2, sharding=Sharding.HYBRID_SHARD, hybrid_mesh=(2, 1))
    )
    args, notes = hf_trainer_config(rec)
    assert (
        "HYBRID_SHARD: pass parallelism_config=accelerate.ParallelismConfig(dp_replicate_size=2, "
        "dp_shard_size=1) (an object, not JSON)"
    ) in notes
    assert args["fsdp_config"]["autoshard"] == {"chosen": describe_evidence(rec), "notes": notes}


def test_a_missing_lightning_names_the_feature_and_a_local_class_comes_from_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch import nn

    class LocalBlock(nn.Module):  # not importable by its path: only the model has it
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

    model = nn.Sequential(LocalBlock(), LocalBlock())
    rec = make_rec(candidate(wrap_classes=(f"{__name__}.{LocalBlock.__qualname__}",)))
    assert rec.strategy(model=model).kwargs["auto_wrap_policy"]._module_classes == {LocalBlock}
    with pytest.raises(ConfigError, match="cannot import class"):
        rec.strategy()
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(MissingDependencyError) as missing:
        make_rec().strategy()
    assert str(missing.value) == (
        "rec.strategy() needs lightning, which is not installed: run "
        "`pip install 'autoshard[lightning]'`"
    )


def test_what_accelerate_cannot_express_word_for_word() -> None:
    from autoshard.emit.prose import Stack, compile_float8_notes
    from autoshard.emit.text import _accelerate_notes

    true = candidate(precision=Precision.BF16_TRUE)
    assert _accelerate_notes(true, Stack.ACCELERATE) == [
        "bf16-true: cast the model to bf16 yourself (model.to(torch.bfloat16))"
    ]
    fsdp2 = candidate(engine=Engine.FSDP2, precision=Precision.BF16_MIXED)
    assert _accelerate_notes(fsdp2, Stack.ACCELERATE) == [
        "accelerate's FSDP2 reduces gradients in the compute dtype; autoshard's trials ran "
        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): pass it as "
        "FullyShardedDataParallelPlugin(mixed_precision_policy=...) for the same"
    ]
    # FSDP1 reduces in the compute dtype as accelerate does: nothing to say
    assert _accelerate_notes(candidate(precision=Precision.BF16_MIXED), Stack.ACCELERATE) == []
    float8 = candidate(engine=Engine.FSDP2, float8=True)
    both = (
        "float8: torchao's Float8Linear on the blocks' linear layers with FSDP2's float8 "
        "all-gather (pip install 'autoshard[float8]'); "
    )
    scales = (
        "; after each optimizer.step() call torchao.float8.precompute_float8_dynamic_scale_for_fsdp"
        "(model), as the trials did"
    )
    assert compile_float8_notes(float8, Stack.LIGHTNING) == [
        f"{both}the FSDP2 plan converts them before fully_shard{scales}"
    ]
    assert compile_float8_notes(float8, Stack.ACCELERATE) == [
        f"{both}accelerate has no key for it: call autoshard.sharding.apply_float8(model, "
        f"rec.chosen.candidate) before preparing the model{scales}"
    ]


def test_lightning_strategy_computes_in_the_precision_the_trials_ran(monkeypatch) -> None:
    # Lightning's FSDPStrategy takes its MixedPrecision from the Trainer's precision plugin
    # unless given one: for every precision, what Lightning will use is what the trials used
    # (sharding.fsdp1_kwargs). FSDP1 reduces in the compute dtype as Lightning's plugin does, so
    # the strategy never needs its own today (the branch that passes one is a guard).
    pytest.importorskip("lightning")
    from autoshard import sharding
    from autoshard.emit.runtime import _lightning_mixed_precision

    monkeypatch.syspath_prepend(str(EXAMPLES))  # the wrap class, gpt.Block
    for precision in Precision:
        c = candidate(precision=precision)
        kwargs = emit.strategy_kwargs(make_rec(c))
        lightning = kwargs.get("mixed_precision") or _lightning_mixed_precision(precision)
        assert lightning == sharding.fsdp1_kwargs(c)["mixed_precision"], precision
