"""A :class:`~autoshard.results.Decision` as text: Lightning CLI YAML (parsed by
jsonargparse into the same ``FSDPStrategy`` that :func:`autoshard.emit.strategy` builds),
accelerate ``fsdp_config`` YAML, and JSON. Each YAML starts with comments saying how the choice
was made and by which version.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

import yaml

from autoshard.config import (
    BackwardPrefetch,
    Candidate,
    Checkpointing,
    Engine,
    Precision,
    Reshard,
    Sharding,
)
from autoshard.emit.runtime import (
    choose_state_dict_type,
    strategy_kwargs,
    trainer_kwargs,
)
from autoshard.errors import ConfigError
from autoshard.results import Decision
from autoshard.units import format_bytes


class ExportFormat(str, Enum):
    """What ``autoshard export --format`` and ``Recommendation.to_yaml`` write."""

    LIGHTNING = "lightning"  # Lightning CLI YAML (trainer.strategy + precision, devices, ...)
    ACCELERATE = "accelerate"  # accelerate config YAML with fsdp_config
    JSON = "json"  # the decision itself, as load_result reads it back


_ACCELERATE_PRECISION = {
    Precision.FP32: "no",
    Precision.BF16_MIXED: "bf16",
    Precision.FP16_MIXED: "fp16",
    Precision.BF16_TRUE: "no",
}


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def describe_evidence(rec: Decision) -> list[str]:
    """What the choice rests on, as comment lines: measured step time and peak, or the estimate."""
    c = rec.chosen
    when = rec.created_at.strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"autoshard {rec.versions.get('autoshard', '')}: {c.candidate.label()}".rstrip()]
    lines.append(
        f"model {rec.profile.target} ({rec.profile.total_params:,} params) on "
        f"{rec.hardware.nodes} x {rec.hardware.gpus_per_node} GPUs of "
        f"{format_bytes(rec.hardware.gpu_memory)}"
    )
    t = c.trial
    if t is not None and t.step_time is not None:
        rate = f", {t.tokens_per_s:,.0f} tokens/s" if t.tokens_per_s else ""
        peak = f", peak {format_bytes(t.max_allocated)} allocated/rank" if t.max_allocated else ""
        lines.append(
            f"measured {t.started_at.strftime('%Y-%m-%d %H:%M UTC')} on {t.world_size} "
            f"{t.device} ranks: {t.step_time:.3f} s/step{rate}{peak}"
        )
    else:
        lines.append(f"chosen {when} by estimate alone (not measured)")
    if c.estimate is not None:
        lines.append(
            f"predicted peak {format_bytes(c.estimate.gpu_peak)}/rank ({c.estimate.method}) of "
            f"{format_bytes(rec.hardware.usable_gpu_memory)} usable"
        )
    return lines


def describe_reshard(c: Candidate) -> str:
    """Which FSDP2 units free their gathered parameters after forward, in ``fully_shard``'s
    terms (``reshard_after_forward``); "" for FSDP1.

    >>> from autoshard import Candidate
    >>> describe_reshard(Candidate(engine="fsdp2", wrap_classes=("gpt.Block",),
    ...                            reshard="keep_root"))[:63]
    'reshard policy keep_root: the root stays gathered after forward'
    """
    if c.engine is not Engine.FSDP2:
        return ""
    if c.sharding is Sharding.SHARD_GRAD_OP:
        return "nothing reshards after forward (SHARD_GRAD_OP: reshard_after_forward=False)"
    match c.reshard:
        case Reshard.ALL:
            what = "every unit reshards after forward (reshard_after_forward=True, root included)"
        case Reshard.KEEP_ROOT:
            what = (
                "the root stays gathered after forward (reshard_after_forward=False on the "
                "root, True on the blocks: fully_shard's default)"
            )
        case Reshard.KEEP_ROOT_AND_LAST:
            what = (
                "the root and the last block stay gathered after forward "
                "(reshard_after_forward=False on them, True on the other blocks: torchtitan's)"
            )
        case _:
            raise ConfigError(f"unknown reshard policy {c.reshard!r}")
    return f"reshard policy {c.reshard.value}: {what}"


def describe_fsdp2_precision(c: Candidate) -> str:
    """FSDP2's ``MixedPrecisionPolicy`` for the candidate's precision (what
    :func:`autoshard.sharding.fsdp2_kwargs` passes); "" without mixed precision.

    >>> from autoshard import Candidate
    >>> describe_fsdp2_precision(Candidate(engine="fsdp2", precision="bf16-mixed"))
    'MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)'
    """
    if not c.precision.mixed:
        return ""
    dtype = "bf16" if c.precision is Precision.BF16_MIXED else "fp16"
    reduce = "fp32" if c.reduce_dtype_fp32 else dtype
    return f"MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={reduce})"


def _comment(lines: list[str]) -> str:
    return "".join(f"# {line}\n" for line in lines)


def lightning_cli_config(rec: Decision) -> dict[str, Any]:
    """The ``trainer:`` section for LightningCLI, as a dict (see :func:`lightning_cli_yaml`)."""
    c = rec.chosen.candidate
    state_dict_type, _ = choose_state_dict_type(rec)
    if c.engine is Engine.FSDP2:
        strategy_cfg: dict[str, Any] = {
            "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
            "init_args": strategy_kwargs(rec),
        }
    else:
        # Policies are LISTS of class paths: a scalar would make jsonargparse build an instance
        # of the block class. Named arguments go in init_args (jsonargparse converts their
        # types); the rest of FSDP's kwargs go in dict_kwargs, passed through unconverted.
        init: dict[str, Any] = {
            "sharding_strategy": c.sharding.value,
            "cpu_offload": c.cpu_offload,
            "state_dict_type": state_dict_type,
        }
        if c.wrap_classes:
            init["auto_wrap_policy"] = list(c.wrap_classes)
        elif c.min_num_params:
            raise ConfigError(
                "a size-based wrap policy cannot be written as Lightning CLI YAML; use "
                "rec.strategy() in code"
            )
        if c.checkpointing is Checkpointing.EVERY_K and c.checkpoint_every > 1:
            init["activation_checkpointing_policy"] = {
                "class_path": "autoshard.emit.EveryKthPolicy",
                "init_args": {
                    "module_classes": list(c.checkpoint_classes),
                    "every": c.checkpoint_every,
                },
            }
        elif c.checkpointing is not Checkpointing.NONE:
            init["activation_checkpointing_policy"] = list(c.checkpoint_classes)
        if c.hybrid_mesh is not None:
            init["device_mesh"] = list(c.hybrid_mesh)
        dict_kwargs: dict[str, Any] = {
            "limit_all_gathers": c.limit_all_gathers,
            "forward_prefetch": c.forward_prefetch,
            "use_orig_params": True,
        }
        # backward_prefetch is an enum: a string under dict_kwargs reaches FSDP unconverted and
        # FSDP silently ignores it. BACKWARD_PRE is FSDP's default; NONE is a plain null.
        if c.backward_prefetch is BackwardPrefetch.NONE:
            dict_kwargs["backward_prefetch"] = None
        elif c.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            raise ConfigError(
                "backward_prefetch=BACKWARD_POST cannot be written as Lightning CLI YAML (an "
                "enum under dict_kwargs is not converted); use rec.strategy() in code"
            )
        strategy_cfg = {
            "class_path": "lightning.pytorch.strategies.FSDPStrategy",
            "init_args": init,
            "dict_kwargs": dict_kwargs,
        }
    return {"trainer": {"strategy": strategy_cfg, **trainer_kwargs(rec)}}


def lightning_cli_yaml(rec: Decision) -> str:
    """Lightning CLI YAML (``trainer:`` section) with comments saying what was measured."""
    lines = describe_evidence(rec)
    lines.append(choose_state_dict_type(rec)[1])
    if rec.chosen.candidate.engine is Engine.FSDP2:
        # ModelParallelStrategy takes no sharding arguments: the plan is code, and it applies
        # the reshard policy the estimates and trials used.
        lines.append("FSDP2: in configure_model() call")
        lines.append('  rec.fsdp2_plan()(self.model, self.device_mesh["data_parallel"])')
        lines.append(f"  which applies the {describe_reshard(rec.chosen.candidate)}")
    body = yaml.safe_dump(lightning_cli_config(rec), sort_keys=False)
    return _comment(lines) + body


def accelerate_config(rec: Decision) -> tuple[dict[str, Any], list[str]]:
    """accelerate's config (``fsdp_config`` and the top-level keys) and the caveats."""
    c = rec.chosen.candidate
    notes: list[str] = []
    state_dict_type, _ = choose_state_dict_type(rec)
    fsdp: dict[str, Any] = {"fsdp_version": 2 if c.engine is Engine.FSDP2 else 1}
    if c.wrap_classes:
        fsdp["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        # accelerate looks the classes up by class NAME among the model's modules.
        fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(
            p.rpartition(".")[2] for p in c.wrap_classes
        )
    elif c.min_num_params:
        fsdp["fsdp_auto_wrap_policy"] = "SIZE_BASED_WRAP"
        fsdp["fsdp_min_num_params"] = c.min_num_params
    else:
        fsdp["fsdp_auto_wrap_policy"] = "NO_WRAP"
    if c.engine is Engine.FSDP2:
        fsdp["fsdp_reshard_after_forward"] = c.sharding is not Sharding.SHARD_GRAD_OP
        if c.sharding is not Sharding.SHARD_GRAD_OP:
            notes.extend(_accelerate_reshard_notes(c))
    else:
        fsdp["fsdp_sharding_strategy"] = c.sharding.value
        fsdp["fsdp_backward_prefetch"] = c.backward_prefetch.value
        fsdp["fsdp_forward_prefetch"] = c.forward_prefetch
        fsdp["fsdp_use_orig_params"] = True
    fsdp["fsdp_offload_params"] = c.cpu_offload
    fsdp["fsdp_state_dict_type"] = (
        "SHARDED_STATE_DICT" if state_dict_type == "sharded" else "FULL_STATE_DICT"
    )
    fsdp["fsdp_activation_checkpointing"] = c.checkpointing is not Checkpointing.NONE
    fsdp["fsdp_cpu_ram_efficient_loading"] = True
    fsdp["fsdp_sync_module_states"] = True
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": _ACCELERATE_PRECISION[c.precision],
        "num_machines": rec.hardware.nodes,
        "num_processes": rec.hardware.world_size,
        "machine_rank": 0,
        "use_cpu": False,
        "fsdp_config": fsdp,
    }
    if c.hybrid_mesh is not None:
        if c.engine is Engine.FSDP2:
            config["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": c.hybrid_mesh[0],
                "parallelism_config_dp_shard_size": c.hybrid_mesh[1],
            }
        else:
            notes.append(
                f"HYBRID_SHARD shards within groups of {c.hybrid_mesh[1]} ranks (accelerate "
                "builds the node-sized groups itself)"
            )
    if c.precision is Precision.BF16_TRUE:
        notes.append("bf16-true: cast the model to bf16 yourself (model.to(torch.bfloat16))")
    if c.checkpointing is Checkpointing.EVERY_K and c.checkpoint_every > 1:
        notes.append(
            f"accelerate checkpoints every block; autoshard chose one in {c.checkpoint_every} "
            "(faster): use autoshard.emit.apply_checkpointing for that"
        )
    if not c.limit_all_gathers:
        notes.append("set fsdp_plugin.limit_all_gathers = False in code (no config key)")
    return config, notes


def _accelerate_reshard_notes(c: Candidate) -> list[str]:
    # accelerate (1.15, utils/fsdp_utils.py fsdp2_prepare_model) makes units of the blocks, of
    # the input embedding and of the final norm + lm_head; fsdp_reshard_after_forward applies to
    # the blocks and the embedding, while the head unit and the root stay gathered after
    # forward whatever the config says. No key expresses autoshard's policies: code does.
    notes = [
        describe_reshard(c),
        "accelerate keeps its final norm + lm_head unit and the root gathered after forward; "
        "for autoshard's policy, after accelerator.prepare(model) call:",
    ]
    match c.reshard:
        case Reshard.ALL:
            notes.append("  model.set_reshard_after_forward(True)")
        case Reshard.KEEP_ROOT | Reshard.KEEP_ROOT_AND_LAST:
            notes.append("  model.get_input_embeddings().set_reshard_after_forward(False)")
            if c.reshard is Reshard.KEEP_ROOT_AND_LAST:
                notes.append(
                    "  model.model.layers[-1].set_reshard_after_forward(False)  # the last block"
                )
    return notes


def accelerate_yaml(rec: Decision) -> str:
    """accelerate config YAML (``accelerate launch --config_file``) with comments."""
    config, notes = accelerate_config(rec)
    return _comment(describe_evidence(rec) + notes) + yaml.safe_dump(config, sort_keys=False)


def to_json(rec: Decision) -> str:
    """The recommendation as JSON (what :func:`autoshard.recommendation.load_result` reads back)."""
    return json.dumps(rec.model_dump(mode="json"), indent=2) + "\n"


def render(rec: Decision, fmt: ExportFormat | str) -> str:
    """The recommendation in ``fmt``: lightning, accelerate or json."""
    try:
        kind = ExportFormat(fmt)
    except ValueError:
        choices = ", ".join(f.value for f in ExportFormat)
        raise ConfigError(f"--format {fmt}: choose one of {choices}") from None
    match kind:
        case ExportFormat.LIGHTNING:
            return lightning_cli_yaml(rec)
        case ExportFormat.ACCELERATE:
            return accelerate_yaml(rec)
        case ExportFormat.JSON:
            return to_json(rec)
