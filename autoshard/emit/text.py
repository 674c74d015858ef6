"""A :class:`~autoshard.results.Decision` as text: Lightning CLI YAML (parsed by
jsonargparse into the same ``FSDPStrategy`` that :func:`autoshard.emit.strategy` builds),
accelerate ``fsdp_config`` YAML, Hugging Face ``TrainingArguments`` keyword arguments (JSON),
and JSON. Each output says how the choice was made and by which version, and what its stack
cannot express as chosen, with the closest faithful setting it uses instead.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import yaml

from autoshard.config import (
    OPTIMIZER_TRAITS,
    BackwardPrefetch,
    Candidate,
    Checkpointing,
    Engine,
    Precision,
    Reshard,
)
from autoshard.emit.prose import (
    Stack,
    choose_state_dict_type,
    comment,
    compile_float8_notes,
    describe_evidence,
    describe_fsdp2_precision,
    describe_optimizer,
    describe_reshard,
    fsdp1_hybrid_notes,
    kv_cache_note,
    optimizer_note,
    selective_note,
)
from autoshard.engine import reshard_after_forward, traits
from autoshard.errors import ConfigError, HandoverNotice
from autoshard.results import Decision

# accelerate's names (accelerate.utils.constants.FSDP_BACKWARD_PREFETCH): "NONE" is not one.
_ACCELERATE_PREFETCH = {
    BackwardPrefetch.BACKWARD_PRE: "BACKWARD_PRE",
    BackwardPrefetch.BACKWARD_POST: "BACKWARD_POST",
    BackwardPrefetch.NONE: "NO_PREFETCH",
}

_ACCELERATE_PRECISION = {
    Precision.FP32: "no",
    Precision.BF16_MIXED: "bf16",
    Precision.FP16_MIXED: "fp16",
    Precision.BF16_TRUE: "no",
}


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


def lightning_cli_config(rec: Decision) -> dict[str, Any]:
    """The ``trainer:`` section for LightningCLI, as a dict (see :func:`lightning_cli_yaml`)."""
    # the strategy's own arguments; imported here: the runtime objects import torch.distributed
    # (1.5 s of CPU), which the command line, reading the formats for its help, need not pay
    from autoshard.emit.runtime import strategy_kwargs, trainer_kwargs

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
            "sharding_strategy": traits(c).fsdp1_name,
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
        lines.append("FSDP2: in configure_model() apply the plan (autoshard-out: tune's --out)")
        lines.append('  rec = autoshard.load("autoshard-out")')
        lines.append('  rec.fsdp2_plan()(self.model, self.device_mesh["data_parallel"])')
        lines.append(f"  (the plan: {describe_reshard(rec.chosen.candidate)})")
    lines.extend(compile_float8_notes(rec.chosen.candidate, Stack.LIGHTNING))
    lines.extend(filter(None, [optimizer_note(rec.chosen.candidate, Stack.LIGHTNING)]))
    note = selective_note(rec.chosen.candidate, Stack.LIGHTNING)
    if note and rec.chosen.candidate.engine is Engine.FSDP1:  # FSDP2's plan applies it
        lines.append(note)
    if rec.chosen.candidate.engine is Engine.FSDP1 and (
        note := kv_cache_note(rec, Stack.LIGHTNING)
    ):
        lines.append(note)
    body = yaml.safe_dump(lightning_cli_config(rec), sort_keys=False)
    return comment(lines) + body


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
        # one value for every unit: the blocks' (the notes say where the root and last differ)
        fsdp["fsdp_reshard_after_forward"] = reshard_after_forward(c)
        if reshard_after_forward(c):
            notes.extend(_accelerate_reshard_notes(c))
    else:
        fsdp["fsdp_sharding_strategy"] = traits(c).accelerate_name
        fsdp["fsdp_backward_prefetch"] = _ACCELERATE_PREFETCH[c.backward_prefetch]
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
    if c.compile:
        # accelerate compiles after prepare; regional compilation compiles each repeated block
        # (accelerate 1.15, utils/dataclasses.py TorchDynamoPlugin.use_regional_compilation),
        # as the trials did.
        config["dynamo_config"] = {
            "dynamo_backend": "INDUCTOR",
            "dynamo_use_regional_compilation": c.engine is Engine.FSDP2,
        }
    if c.hybrid_mesh is not None and c.engine is Engine.FSDP2:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": c.hybrid_mesh[0],
            "parallelism_config_dp_shard_size": c.hybrid_mesh[1],
        }
    notes.extend(fsdp1_hybrid_notes(rec, Stack.ACCELERATE))
    notes.extend(_accelerate_notes(c, Stack.ACCELERATE))
    notes.extend(filter(None, [kv_cache_note(rec, Stack.ACCELERATE)]))
    notes.extend(compile_float8_notes(c, Stack.ACCELERATE))
    notes.extend(filter(None, [optimizer_note(c, Stack.ACCELERATE)]))
    if not c.limit_all_gathers:
        notes.append("set fsdp_plugin.limit_all_gathers = False in code (no config key)")
    return config, notes


def _accelerate_notes(c: Candidate, stack: Stack) -> list[str]:
    """What accelerate (and the Hugging Face Trainer, which builds accelerate's FSDP plugin)
    cannot express as chosen, and the closest setting the output uses."""
    notes: list[str] = []
    if c.precision is Precision.BF16_TRUE:
        notes.append("bf16-true: cast the model to bf16 yourself (model.to(torch.bfloat16))")
    if c.checkpointing is Checkpointing.EVERY_K and c.checkpoint_every > 1:
        notes.append(
            f"{stack.value} checkpoints every block or none; autoshard chose one in "
            f"{c.checkpoint_every} (faster): this config checkpoints every block (less memory, "
            "slower); for one in k call rec.apply_checkpointing(model) instead"
        )
    if note := selective_note(c, stack):
        notes.append(note)
    if c.checkpointing is not Checkpointing.NONE and set(c.checkpoint_classes) != set(
        c.wrap_classes
    ):
        notes.append(
            f"{stack.value} checkpoints the wrapped classes "
            f"({', '.join(c.wrap_classes) or 'none'}); autoshard checkpoints "
            f"{', '.join(c.checkpoint_classes)}: call rec.apply_checkpointing(model) for that"
        )
    if c.engine is Engine.FSDP2 and describe_fsdp2_precision(c) and c.reduce_dtype_fp32:
        notes.append(
            f"{stack.value}'s FSDP2 reduces gradients in the compute dtype; autoshard's trials ran "
            f"{describe_fsdp2_precision(c)}: pass it as "
            "FullyShardedDataParallelPlugin(mixed_precision_policy=...) for the same"
        )
    return notes


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
    return comment(describe_evidence(rec) + notes) + yaml.safe_dump(config, sort_keys=False)


def hf_trainer_config(rec: Decision) -> tuple[dict[str, Any], list[str]]:
    """Hugging Face ``TrainingArguments`` keyword arguments (transformers 5: ``fsdp=True`` and
    everything in ``fsdp_config``, whose keys ``TrainingArguments._process_fsdp_args`` reads)
    and what the Trainer cannot express as chosen."""
    c = rec.chosen.candidate
    state_dict_type, _ = choose_state_dict_type(rec)
    fsdp: dict[str, Any] = {"version": 2 if c.engine is Engine.FSDP2 else 1}
    if c.wrap_classes:
        fsdp["auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        # Looked up by class NAME among the model's modules (accelerate, as above).
        fsdp["transformer_layer_cls_to_wrap"] = [p.rpartition(".")[2] for p in c.wrap_classes]
    elif c.min_num_params:
        fsdp["auto_wrap_policy"] = "SIZE_BASED_WRAP"
        fsdp["min_num_params"] = c.min_num_params
    else:
        fsdp["auto_wrap_policy"] = "NO_WRAP"
    notes: list[str] = []
    if c.engine is Engine.FSDP2:
        fsdp["reshard_after_forward"] = reshard_after_forward(c)  # the blocks', as above
        if reshard_after_forward(c) and c.reshard is not Reshard.ALL:
            notes.append(
                f"{describe_reshard(c)}; the Trainer (accelerate) has no key for it and keeps "
                "its final norm + lm_head unit and the root gathered after forward"
            )
        if c.hybrid_mesh is not None:
            notes.append(
                f"{c.sharding.value}: pass parallelism_config=accelerate.ParallelismConfig("
                f"dp_replicate_size={c.hybrid_mesh[0]}, dp_shard_size={c.hybrid_mesh[1]}) "
                "(an object, not JSON)"
            )
    else:
        # FSDP1 takes the sharding strategy's name here (a hybrid one: accelerate builds the
        # node-sized groups itself).
        fsdp["reshard_after_forward"] = traits(c).hf_trainer_name
        fsdp["forward_prefetch"] = c.forward_prefetch
        # The Trainer's default is NO_PREFETCH, FSDP's is BACKWARD_PRE: always say which.
        fsdp["backward_prefetch"] = _ACCELERATE_PREFETCH[c.backward_prefetch]
        fsdp["use_orig_params"] = True
        fsdp["sync_module_states"] = True
        fsdp["limit_all_gathers"] = c.limit_all_gathers
        notes.extend(fsdp1_hybrid_notes(rec, Stack.HF_TRAINER))
    fsdp["cpu_offload"] = c.cpu_offload
    # FSDP's own checkpointing: the Trainer's activation_checkpointing (gradient_checkpointing)
    # argument would add an all-gather in backward (transformers' own advice).
    fsdp["activation_checkpointing"] = c.checkpointing is not Checkpointing.NONE
    fsdp["state_dict_type"] = (
        "SHARDED_STATE_DICT" if state_dict_type == "sharded" else "FULL_STATE_DICT"
    )
    fsdp["cpu_ram_efficient_loading"] = True
    notes.extend(_accelerate_notes(c, Stack.HF_TRAINER))
    notes.extend(filter(None, [kv_cache_note(rec, Stack.HF_TRAINER)]))
    notes.extend(compile_float8_notes(c, Stack.HF_TRAINER))
    optimizer = _hf_optimizer(c, notes)
    # Read by nobody but people: the Trainer stores unknown fsdp_config keys and ignores them.
    fsdp["autoshard"] = {"chosen": describe_evidence(rec), "notes": notes}
    args: dict[str, Any] = {"fsdp": True, "fsdp_config": fsdp}
    if c.precision is Precision.BF16_MIXED:
        args["bf16"] = True
    elif c.precision is Precision.FP16_MIXED:
        args["fp16"] = True
    if c.compile:
        args["torch_compile"] = True
    args.update(optimizer)
    args["per_device_train_batch_size"] = c.micro_batch_size
    if rec.workload.accumulate > 1:
        args["gradient_accumulation_steps"] = rec.workload.accumulate
    return args, notes


def _hf_optimizer(c: Candidate, notes: list[str]) -> dict[str, Any]:
    """``TrainingArguments``' ``optim`` (and ``optim_args``) for the optimizer the trials built,
    or a note saying how to hand it to the Trainer where it has no name for it."""
    row = OPTIMIZER_TRAITS[c.optimizer]
    name = row.hf_trainer_names.get(c.optimizer_impl)
    if name is None:
        arguments = row.arguments(c.optimizer_impl)
        notes.append(
            f"the Trainer has no optim name for {describe_optimizer(c)}: pass "
            f"Trainer(optimizer_cls_and_kwargs=({row.class_path}, {arguments!r}))"
        )
        return {}
    optim: dict[str, Any] = {"optim": name}
    if row.options:  # read by the Trainer as comma-separated key=value
        optim["optim_args"] = ",".join(f"{k}={v}" for k, v in row.options.items())
    return optim


def trainer_arguments(rec: Decision) -> dict[str, Any]:
    """``TrainingArguments(output_dir, **trainer_arguments(rec))``: see :func:`hf_trainer_config`;
    each setting it cannot express as chosen is a :class:`~autoshard.errors.HandoverNotice`."""
    args, notes = hf_trainer_config(rec)
    for note in notes:
        warnings.warn(f"Hugging Face Trainer: {note}", HandoverNotice, stacklevel=3)
    return args


def hf_trainer_json(rec: Decision) -> str:
    """:func:`hf_trainer_config` as JSON (``TrainingArguments(**json.load(f))``, or
    ``HfArgumentParser(TrainingArguments).parse_json_file``)."""
    return json.dumps(hf_trainer_config(rec)[0], indent=2) + "\n"


def to_json(rec: Decision) -> str:
    """The recommendation as JSON (what :func:`autoshard.recommendation.load_result` reads back)."""
    return json.dumps(rec.model_dump(mode="json"), indent=2) + "\n"
