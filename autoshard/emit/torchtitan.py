"""A :class:`~autoshard.results.Decision` as torchtitan's job config TOML (torchtitan 0.2, the
last release read from TOML: ``--job.config_file``): the sections and keys of its
``torchtitan/config/job_config.py`` that carry the choice, to merge into the job's own config
(the model, its data and the steps are the job's). Comments say what was measured and what
torchtitan cannot express as chosen, with the closest faithful setting the file uses.

torchtitan runs FSDP2 on its own models: it wraps the token embedding, each block and the final
norm with the output head, then the root; an FSDP1 decision, or fp16, has no torchtitan form.
"""

from __future__ import annotations

import json
from typing import Any

from autoshard.config import (
    OPTIMIZER_TRAITS,
    Checkpointing,
    Engine,
    OptimizerImpl,
    Precision,
    Reshard,
)
from autoshard.emit.prose import comment, describe_evidence, describe_reshard
from autoshard.engine import shard_group, traits
from autoshard.errors import ConfigError
from autoshard.results import Decision

# torchtitan's Optimizer.implementation names (job_config.py)
_IMPLEMENTATION = {
    OptimizerImpl.FOREACH: "foreach",
    OptimizerImpl.FUSED: "fused",
    OptimizerImpl.FOR_LOOP: "for-loop",
}


def torchtitan_config(rec: Decision) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The TOML's sections (``"quantize.linear.float8"`` is a dotted table) and the caveats."""
    c = rec.chosen.candidate
    if c.engine is not Engine.FSDP2:
        raise ConfigError(
            "torchtitan runs FSDP2 (fully_shard) only, and this decision is FSDP1: plan with "
            "--engine fsdp2 for a torchtitan config"
        )
    if c.precision is Precision.FP16_MIXED:
        raise ConfigError(
            "torchtitan trains in bf16 or fp32, not 16-mixed: plan with --precision bf16-mixed "
            "(or 32-true) for a torchtitan config"
        )
    optimizer = OPTIMIZER_TRAITS[c.optimizer].torchtitan_name
    if optimizer is None:
        names = [o.value for o, row in OPTIMIZER_TRAITS.items() if row.torchtitan_name]
        raise ConfigError(
            f"torchtitan builds {' or '.join(names)} only, not {c.optimizer.value}: plan with "
            "--optimizer adamw for a torchtitan config"
        )
    notes: list[str] = []
    shard, replicas = shard_group(c, rec.hardware)
    sections: dict[str, dict[str, Any]] = {
        "training": _training(rec, notes),
        "parallelism": {
            "data_parallel_shard_degree": shard,
            "data_parallel_replicate_degree": replicas,
            "fsdp_reshard_after_forward": _reshard_policy(rec, notes),
        },
        "activation_checkpoint": _checkpointing(rec, notes),
        # the blocks compiled, not the loss (torchtitan's components: model, loss)
        "compile": {"enable": True, "components": ["model"]} if c.compile else {"enable": False},
        "optimizer": {
            "name": optimizer,
            "implementation": _IMPLEMENTATION[c.optimizer_impl],
        },
    }
    if c.float8:
        # the blocks' linear layers with FSDP2's float8 all-gather and one all-reduce of the
        # scales after each step, as the trials ran them; the head stays bf16 ("output")
        sections["model"] = {"converters": ["quantize.linear.float8"]}
        sections["quantize.linear.float8"] = {
            "enable_fsdp_float8_all_gather": True,
            "precompute_float8_dynamic_scale_for_fsdp": True,
            "filter_fqns": ["output"],
        }
    if c.one_unit:
        notes.append(
            "torchtitan shards its model block by block; autoshard chose the whole model as one "
            "unit (fewer collectives): this config shards per block (less memory, more "
            "collectives)"
        )
    if replicas > 1 and shard == 1:
        notes.append(
            f"{c.sharding.value}: torchtitan replicates with DDP where the shard degree is 1 "
            "(autoshard's trials ran fully_shard on a (world, 1) mesh): the same memory of "
            "parameters, gradients and optimizer states"
        )
    return sections, notes


def _training(rec: Decision, notes: list[str]) -> dict[str, Any]:
    """``[training]``: the micro-batch, the sequence, the dtypes and CPU offload."""
    c = rec.chosen.candidate
    training: dict[str, Any] = {"local_batch_size": c.micro_batch_size}
    if rec.workload.seq_len is not None:
        training["seq_len"] = rec.workload.seq_len
    if rec.workload.accumulate > 1:
        # torchtitan accumulates global / (local x data-parallel ranks) micro-batches
        world = rec.hardware.world_size
        training["global_batch_size"] = c.micro_batch_size * world * rec.workload.accumulate
        notes.append(
            f"{rec.workload.accumulate} micro-batches accumulate per step; torchtitan reduces "
            "gradients after each of them (no skipped sync)"
        )
    training["dtype"] = "bfloat16" if c.precision is Precision.BF16_TRUE else "float32"
    training["mixed_precision_param"] = "float32" if c.precision is Precision.FP32 else "bfloat16"
    training["mixed_precision_reduce"] = "float32"  # torchtitan's only choice
    reduces_low = c.precision is Precision.BF16_TRUE or (
        c.precision.mixed and not c.reduce_dtype_fp32
    )
    if reduces_low:
        notes.append(
            "torchtitan reduces gradients in fp32; autoshard's trials reduced them in bf16 "
            "(fp32 reductions move twice the bytes)"
        )
    training["enable_cpu_offload"] = c.cpu_offload
    return training


def _reshard_policy(rec: Decision, notes: list[str]) -> str:
    """``fsdp_reshard_after_forward``: torchtitan's "always" reshards every unit after forward,
    "never" none, "default" all but the final norm with the output head."""
    c = rec.chosen.candidate
    if traits(c).keeps_gathered:
        return "never"
    if c.reshard is Reshard.ALL:
        return "always"
    notes.append(
        f"{describe_reshard(c)}; torchtitan's nearest policy, default, keeps its final norm + "
        "output unit gathered and reshards the token embedding"
        + (" and the last block" if c.reshard is Reshard.KEEP_ROOT_AND_LAST else "")
        + " (less memory, one more all-gather each in backward)"
    )
    return "default"


def _checkpointing(rec: Decision, notes: list[str]) -> dict[str, Any]:
    """``[activation_checkpoint]``: torchtitan checkpoints its blocks, whole ("full"), every
    k-th ("selective", an integer option) or op by op ("selective", "op")."""
    c = rec.chosen.candidate
    match c.checkpointing:
        case Checkpointing.NONE:
            return {"mode": "none"}
        case Checkpointing.ALL:
            return {"mode": "full"}
        case Checkpointing.SELECTIVE:
            return {"mode": "selective", "selective_ac_option": "op"}
        case Checkpointing.EVERY_K:
            k, blocks = c.checkpoint_every, rec.profile.block_count
            if blocks % k:
                # torchtitan counts blocks from 1 and checkpoints k, 2k, ...; autoshard 0, k, ...
                notes.append(
                    f"torchtitan checkpoints blocks {k}, {2 * k}, ... (counting from 1): "
                    f"{blocks // k} of {blocks}; autoshard checkpointed {-(-blocks // k)} "
                    f"(blocks 1, {1 + k}, ...): one block more keeps its activations (more memory)"
                )
            return {"mode": "selective", "selective_ac_option": str(k)}
        case _:
            raise ConfigError(f"unknown checkpointing {c.checkpointing!r}")


def _value(value: Any) -> str:
    """A TOML value: booleans, numbers, strings and lists of them (JSON writes them alike)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(value)


def torchtitan_toml(rec: Decision) -> str:
    """torchtitan job config TOML with comments saying what was measured and what differs."""
    sections, notes = torchtitan_config(rec)
    hw = rec.hardware
    launch = (
        f"torchtitan: merge into your job config; run on {hw.nodes} x {hw.gpus_per_node} GPUs "
        f"(torchrun --nnodes {hw.nodes} --nproc_per_node {hw.gpus_per_node})"
    )
    lines = [*describe_evidence(rec), launch, *notes]
    body = "\n".join(
        f"[{name}]\n" + "".join(f"{key} = {_value(v)}\n" for key, v in table.items())
        for name, table in sections.items()
    )
    return comment(lines) + "\n" + body
