"""The prose every output of :mod:`autoshard.emit` shares: what a choice rests on, what each
FSDP2 setting does, which state dict to save, and what a stack (:class:`Stack`) cannot express as
chosen, with the closest faithful setting it uses instead. The text formats
(:mod:`autoshard.emit.text`, :mod:`autoshard.emit.torchtitan`), the runtime objects'
notices (:mod:`autoshard.emit.runtime`) and the reports (:mod:`autoshard.ui`) read it here.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from autoshard.config import (
    OPTIMIZER_TRAITS,
    Candidate,
    Checkpointing,
    Engine,
    Optimizer,
    OptimizerImpl,
    Precision,
    Reshard,
)
from autoshard.engine import traits
from autoshard.errors import ConfigError
from autoshard.results import Decision
from autoshard.units import format_bytes


class Stack(Enum):
    """Who reads an output, by the name its prose gives it (``accelerate``); what differs in
    the wording is a property here, not a comparison of names."""

    LIGHTNING = "Lightning"
    ACCELERATE = "accelerate"
    HF_TRAINER = "the Hugging Face Trainer"
    TORCHTITAN = "torchtitan"

    @property
    def checkpointer(self) -> str:
        """What checkpoints activations in it (Lightning's FSDP1 strategy does, in Lightning)."""
        return "Lightning's FSDPStrategy" if self is Stack.LIGHTNING else self.value

    @property
    def applies_plan(self) -> bool:
        """Its output applies autoshard's FSDP2 plan (``rec.fsdp2_plan()`` in Lightning's
        ``configure_model``), and with it the plan's torch.compile and float8."""
        return self is Stack.LIGHTNING

    @property
    def optimizer_home(self) -> str:
        """Where its training script builds the optimizer, its config having no key for it
        ("" where it has one)."""
        return {
            Stack.LIGHTNING: "configure_optimizers (or LightningCLI's optimizer: class_path)",
            Stack.ACCELERATE: "the script, before accelerator.prepare",
        }.get(self, "")

    @property
    def compiles_by_key(self) -> bool:
        """A key of its config compiles the wrapped model (accelerate's ``dynamo_config``, the
        Hugging Face Trainer's ``torch_compile``)."""
        return self in (Stack.ACCELERATE, Stack.HF_TRAINER)


StateDictType = Literal["full", "sharded"]

# A full state dict gathers every fp32 parameter (and Adam's two moments with the optimizer
# state) on rank 0's host memory. Above this size that takes minutes and tens of GiB per save.
_FULL_STATE_DICT_LIMIT = 8 * 2**30


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
        rate = f", {t.tokens_per_s_per_gpu:,.0f} tokens/s {t.per_gpu}" if t.tokens_per_s else ""
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
    if traits(c).keeps_gathered:
        return f"nothing reshards after forward ({c.sharding.value}: reshard_after_forward=False)"
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


def comment(lines: list[str]) -> str:
    """``lines`` as comment lines of YAML or TOML."""
    return "".join(f"# {line}\n" for line in lines)


def choose_state_dict_type(rec: Decision) -> tuple[StateDictType, str]:
    """``"sharded"`` for big models, ``"full"`` otherwise; with the reason, for people."""
    full = rec.profile.total_params * 4  # fp32 master weights, gathered on rank 0
    limit = _FULL_STATE_DICT_LIMIT
    if rec.hardware.host_memory:
        limit = min(limit, rec.hardware.host_memory // 4)
    if full > limit:
        return "sharded", (
            f"state_dict_type=sharded: a full checkpoint would gather {format_bytes(full)} of "
            f"fp32 weights (plus optimizer state) on rank 0's host memory at every save"
        )
    return "full", (
        f"state_dict_type=full: the model's {format_bytes(full)} of fp32 weights gather on rank 0 "
        "quickly, and one file loads anywhere without FSDP"
    )


def selective_note(candidate: Candidate, stack: Stack) -> str | None:
    """Why ``stack`` cannot express selective (op-level) checkpointing, what its output does
    instead, and what applies it as chosen; None where there is nothing to say. The closest
    faithful setting is whole blocks: it keeps less than op-level does, so what fit still fits
    (and recomputes more: slower than measured)."""
    if candidate.checkpointing is not Checkpointing.SELECTIVE:
        return None
    return (
        f"{stack.checkpointer} checkpoints whole blocks only (no per-operation policy, no "
        "context_fn); autoshard chose selective op-level checkpointing (torchtitan's policy): this "
        "checkpoints whole blocks instead (less memory, slower); for op-level, apply "
        "rec.apply_checkpointing(model) or rec.apply(model)"
        + (", or plan for FSDP2 (ModelParallelStrategy applies it)" if stack.applies_plan else "")
    )


def kv_cache_note(rec: Decision, stack: Stack) -> str | None:
    """What ``stack`` leaves on that the plan assumed off: a Hugging Face model's key/value cache
    under activation checkpointing (autoshard's trials, ``rec.apply`` and the estimates turn it
    off, as ``gradient_checkpointing_enable`` does; FSDP's own checkpointing does not)."""
    c = rec.chosen.candidate
    hf = any(k.class_path.startswith("transformers.") for k in rec.profile.classes)
    if c.checkpointing is Checkpointing.NONE or not hf:
        return None
    return (
        f"{stack.checkpointer} checkpoints without turning off the Hugging Face model's key/value "
        "cache: set model.config.use_cache = False before training, as autoshard's trials and "
        "estimates did (with it on, every layer's keys and values stay alive beside the "
        "checkpointed blocks)"
    )


def compile_float8_notes(c: Candidate, stack: Stack) -> list[str]:
    """How ``stack`` gets the torch.compile and float8 the trials ran with (its config has no
    key for them, or only a coarser one): never left out in silence."""
    notes: list[str] = []
    if c.compile and c.engine is Engine.FSDP2:
        notes.append(
            "torch.compile: each block compiled in place (module.compile()) before fully_shard, "
            "as torchtitan does; the FSDP2 plan (rec.fsdp2_plan() in configure_model, or "
            "rec.apply(model)) applies it"
            + (
                ""
                if stack.applies_plan
                else f"; {stack.value}'s own compile flag compiles it whole"
            )
        )
    elif c.compile:
        notes.append(
            "torch.compile: the wrapped model compiled whole (FSDP1), as the setting here does"
            if stack.compiles_by_key
            else f"torch.compile: the wrapped model compiled whole (FSDP1); {stack.value} has no "
            "key for it here: call model.compile() after wrapping (rec.apply(model) does)"
        )
    if c.float8:
        notes.append(
            "float8: torchao's Float8Linear on the blocks' linear layers with FSDP2's float8 "
            "all-gather (pip install 'autoshard[float8]'); "
            + (
                "the FSDP2 plan converts them before fully_shard"
                if stack.applies_plan
                else f"{stack.value} has no key for it: call "
                "autoshard.sharding.apply_float8(model, rec.chosen.candidate) before preparing the "
                "model"
            )
            + "; after each optimizer.step() call torchao.float8."
            "precompute_float8_dynamic_scale_for_fsdp(model), as the trials did"
        )
    return notes


def fsdp1_hybrid_notes(rec: Decision, stack: Stack) -> list[str]:
    """FSDP1's hybrid sharding in accelerate shards within each node, a group that no key
    changes: said, with what to do where autoshard chose other groups."""
    c = rec.chosen.candidate
    if c.engine is not Engine.FSDP1 or c.hybrid_mesh is None:
        return []
    per_node = rec.hardware.gpus_per_node
    if c.hybrid_mesh[1] == per_node:
        return [
            f"{c.sharding.value} shards within each node ({per_node} ranks), as {stack.value} does"
        ]
    return [
        f"{stack.value}'s {c.sharding.value} shards within each node ({per_node} ranks); autoshard "
        f"chose groups of {c.hybrid_mesh[1]} (mesh {c.hybrid_mesh[0]} x {c.hybrid_mesh[1]}), which "
        f"{stack.value} has no setting for: rec.apply(model) applies it"
    ]


def describe_optimizer(c: Candidate) -> str:
    """The optimizer the trials built, as the call that builds it.

    >>> describe_optimizer(Candidate(optimizer="sgd"))
    'torch.optim.SGD(momentum=0.9, foreach=True)'
    """
    row = OPTIMIZER_TRAITS[c.optimizer]
    arguments = ", ".join(f"{k}={v!r}" for k, v in row.arguments(c.optimizer_impl).items())
    return f"{row.class_path}({arguments})"


def optimizer_note(c: Candidate, stack: Stack) -> str | None:
    """The optimizer to build where ``stack``'s config has no key for it; None where the trials
    ran torch.optim.AdamW as it builds by default (foreach)."""
    if (c.optimizer, c.optimizer_impl) == (Optimizer.ADAMW, OptimizerImpl.FOREACH):
        return None
    return (
        f"optimizer: {describe_optimizer(c)}, as the trials built it; {stack.optimizer_home} "
        "builds it"
    )
