"""The rules of a micro-batch's forward events, by the turn of the step's timeline they happen in
(:mod:`autoshard.predict.step_memory` walks the turns and calls them, adding the gradients
carried into the micro-batch), and what a synced micro-batch's own gradients are
(:func:`unreduced`).

The forward's events hold the peak only when gradients are alive through it (Lightning's
order, accumulation). Without gradients each is below a backward event that holds the same
working set and more, but the forward's own are the peak where backward holds little (frozen
parameters, LoRA: no weight gradients). Measured on fake tensors (torch 2.13, the tracker's
snapshot at every module's forward):

- the end of forward, inside the loss: the logits in the compute dtype, their fp32 copy (a
  cast, or the non-contiguous shifted slice of a micro-batch above 1) and the fp32
  log-probabilities (counted with the saved activations);
- FSDP2: the forward's start (the root's all-gather and the first block's prefetch, each a
  buffer and a copy), the last block's all-gather (its buffer beside the previous unit's, which
  FSDP2 keeps until the root's forward ends, with every earlier block's activations saved), the
  end of the last block's forward, and the end of the root's forward (the logits made, the root
  still gathered: FSDP2 gathers a copy even with NO_SHARD);
- FSDP1: the end of the root's forward (the root, or its low-precision copy, still held with
  the logits) and, with resharding units, the end of the last block's forward (FSDP1 gathers
  into the flat parameter itself: no buffer).
"""

from __future__ import annotations

from autoshard.config import Engine
from autoshard.engine import resharded_sharding, traits
from autoshard.predict.step_bytes import StepBytes, last_block_all_activations
from autoshard.results import MemoryBreakdown


def loss(t: StepBytes) -> MemoryBreakdown:
    """The loss, at the end of forward: every activation saved; the logits, their shifted copy
    (or fp32 cast) and the log-probabilities alive together. A model that computes its loss in
    forward (a Hugging Face model given labels) has the root's backward hooks on the loss
    itself: the root is gathered and the last block prefetched before the loss's backward,
    beside its temporaries (simulated)."""
    early = t.acts.loss_in_forward and t.reshards_blocks
    unsharded = t.backward_start_unsharded_bytes if early else t.kept_after_forward_bytes
    return MemoryBreakdown(
        sharded_params=t.param_shard_bytes,
        unsharded_params=unsharded,
        optimizer=t.optimizer_bytes,
        comm_buffers=t.gather_buffer_bytes if early else 0,
        activations=t.saved_bytes,
        temporaries=2 * t.logits_grad_bytes,
        buffers=t.profile.buffer_bytes,
    )


def _resident(t: StepBytes) -> MemoryBreakdown:
    """What every forward event holds: the loss's event without its temporaries (the sharded
    state, the buffers; the other terms each forward event sets)."""
    return loss(t).model_copy(update={"temporaries": 0})


def _through_blocks(t: StepBytes) -> int:
    """The activations saved once every block has run forward (all but the loss's)."""
    return t.saved_bytes - t.loss_saved_bytes


def _unit_bytes(t: StepBytes) -> tuple[int, int, int]:
    """(all parameters, the root unit's, a block unit's) in bytes of the compute dtype."""
    cb = t.compute_dtype_bytes
    unit = 0 if t.candidate.one_unit else t.profile.block_params * cb
    return t.params * cb, t.root_params * cb, unit


def _last_gather_buffer(t: StepBytes) -> int:
    """FSDP2's all-gather buffer of the last unit its forward gathered (the last block's, or the
    one unit's), alive from the last block's forward until the root's forward ends; none on one
    rank."""
    _, root, unit = _unit_bytes(t)
    return 0 if t.shard == 1 else (unit or root)


def forward_start(t: StepBytes) -> dict[str, MemoryBreakdown]:
    """FSDP2, at the root's forward turn: every unit was resharded after the last backward;
    the root is gathered (its all-gather buffer beside its copy) as the first block is
    prefetched."""
    if t.engine is not Engine.FSDP2:
        return {}
    _, root, unit = _unit_bytes(t)
    update = {
        "unsharded_params": root + unit,
        "activations": 0,
        "comm_buffers": 0 if t.shard == 1 else root + unit,
    }
    return {"forward start": _resident(t).model_copy(update=update)}


def last_block_forward(t: StepBytes) -> dict[str, MemoryBreakdown]:
    """At the last block's forward turn: FSDP2's all-gather of it and the end of its forward;
    FSDP1's end of its forward where units reshard (or NO_SHARD casts a low-precision copy of
    each unit beside the root's: simulated, a LoRA Llama's peak in Lightning's order)."""
    everything, root, unit = _unit_bytes(t)
    base = _resident(t)
    through = _through_blocks(t)
    if t.engine is Engine.FSDP2:
        keeps_all = traits(t.candidate).keeps_gathered
        gathered = everything if keeps_all or t.candidate.one_unit else root + unit
        buffer = _last_gather_buffer(t)
        last = last_block_all_activations(t.candidate, t.acts)
        return {
            "last block all-gather": base.model_copy(
                update={
                    "unsharded_params": gathered,
                    "activations": through - last,
                    "comm_buffers": 2 * buffer,
                }
            ),
            "last block forward": base.model_copy(
                update={
                    "unsharded_params": gathered,
                    "activations": through,
                    "comm_buffers": buffer,
                }
            ),
        }
    copies = not traits(t.candidate).shards_params and t.mixed
    if (resharded_sharding(t.candidate) or copies) and not t.candidate.one_unit:
        return {
            "last block forward": base.model_copy(
                update={"unsharded_params": root + unit, "activations": through}
            )
        }
    return {}


def forward_end(t: StepBytes) -> dict[str, MemoryBreakdown]:
    """At the root's work after the blocks: the end of the root's forward, the end of forward
    inside the loss, and the loss (:func:`loss`)."""
    everything, root, _ = _unit_bytes(t)
    base = _resident(t)
    keeps_all = traits(t.candidate).keeps_gathered
    if t.engine is Engine.FSDP2:
        buffer = _last_gather_buffer(t)
        update = {
            "unsharded_params": everything if keeps_all else root,
            "activations": base.activations,
            "comm_buffers": buffer,
        }
    else:
        held = everything if keeps_all else root if t.gathers else 0
        update = {"unsharded_params": held, "activations": base.activations}
    the_loss = loss(t)
    logits = the_loss.temporaries // 2  # the fp32 logits' size
    copied = t.compute_dtype_bytes != 4 or t.candidate.micro_batch_size > 1
    end = logits * t.compute_dtype_bytes // 4 + (logits if copied else 0)
    return {
        "root forward end": base.model_copy(update=update),
        "forward end": the_loss.model_copy(update={"temporaries": end}),
        "loss": the_loss,
    }
