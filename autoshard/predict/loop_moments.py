"""The memory moments the user's loop adds to those of one plain step
(:mod:`autoshard.predict.moments`): the forward's own moments, Lightning's order (the last step's
gradients alive through the next forward), and gradient accumulation, with the sync skipped
(:func:`no_sync_moments`) or not (:func:`synced_accumulation_moments`).
"""

from __future__ import annotations

from autoshard.config import Candidate, Engine, Hardware, Loop, WorkloadSpec
from autoshard.engine import (
    as_run,
    element_bytes,
    gradient_params,
    resharded_sharding,
    shard_size,
    skips_gradient_sync,
    traits,
)
from autoshard.predict.accumulation import no_sync_moments, synced_accumulation_moments
from autoshard.predict.activations import ActivationProfile
from autoshard.predict.moments import backward_start_moments
from autoshard.results import MemoryBreakdown, ModelProfile


def forward_moments(
    moments: dict[str, MemoryBreakdown],
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    acts: ActivationProfile,
) -> dict[str, MemoryBreakdown]:
    """Moments of the forward, which hold the peak only when gradients are alive through it
    (Lightning's order, accumulation; see :func:`loop_moments`). Without gradients each is below
    a backward moment that holds the same working set and more. Measured on fake tensors (torch
    2.13, the tracker's snapshot at every module's forward):

    - the end of forward, inside the loss: the logits in the compute dtype, their fp32 copy (a
      cast, or the non-contiguous shifted slice of a micro-batch above 1) and the fp32
      log-probabilities (counted with the saved activations);
    - FSDP2: the forward's start (the root's all-gather and the first block's prefetch, each
      a buffer and a copy), the last block's all-gather (its buffer beside the previous
      unit's, which FSDP2 keeps until the root's forward ends, with every earlier block's
      activations saved), the
      end of the last block's forward, and the end of the root's forward (the logits made, the
      root still gathered: FSDP2 gathers a copy even with NO_SHARD);
    - FSDP1: the end of the root's forward (the root, or its low-precision copy, still held
      with the logits) and, with resharding units, the end of the last block's forward (FSDP1
      gathers into the flat parameter itself: no buffer)."""
    candidate = as_run(candidate, hardware)
    _, cb = element_bytes(candidate.precision)
    loss = moments["loss"]
    logits = loss.temporaries // 2  # the fp32 logits' size (see peak_moments)
    copied = cb != 4 or candidate.micro_batch_size > 1
    out = {
        "forward end": loss.model_copy(
            update={"temporaries": logits * cb // 4 + (logits if copied else 0)}
        )
    }
    at = acts.at(candidate.precision)
    saved = loss.activations
    through_blocks = saved - candidate.micro_batch_size * at.loss_bytes
    last = int(at.block_bytes[-1] * at.scale(candidate)) if at.block_bytes else 0
    base = loss.model_copy(update={"temporaries": 0})
    if candidate.engine is Engine.FSDP2:
        out.update(_fsdp2_forward(base, profile, candidate, hardware, through_blocks, last))
    else:
        out.update(_fsdp1_forward(base, profile, candidate, hardware, through_blocks))
    return out


def _gathered_units(profile: ModelProfile, candidate: Candidate) -> tuple[int, int, int]:
    """(all parameters, the root unit's, a block unit's) in bytes of the compute dtype."""
    _, cb = element_bytes(candidate.precision)
    params = profile.total_params
    unit_bytes = 0 if candidate.one_unit else profile.block_params * cb
    root_bytes = params * cb if candidate.one_unit else profile.root_unit_params * cb
    return params * cb, root_bytes, unit_bytes


def _fsdp2_forward(
    base: MemoryBreakdown,
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    through_blocks: int,
    last: int,
) -> dict[str, MemoryBreakdown]:
    """FSDP2's forward moments (:func:`forward_moments`); ``base``: the loss's, without its
    temporaries."""
    everything, root_bytes, unit_bytes = _gathered_units(profile, candidate)
    keeps_all = traits(candidate).keeps_gathered
    gathered = everything if keeps_all or candidate.one_unit else root_bytes + unit_bytes
    buffer = 0 if shard_size(candidate, hardware) == 1 else (unit_bytes or root_bytes)
    # The forward's start: every unit was resharded after the last backward; the root is
    # gathered (its all-gather buffer beside its copy) as the first block is prefetched.
    gathering = root_bytes + unit_bytes
    start = {
        "unsharded_params": gathering,
        "activations": 0,
        "comm_buffers": 0 if shard_size(candidate, hardware) == 1 else gathering,
    }
    last_gather = {
        "unsharded_params": gathered,
        "activations": through_blocks - last,
        "comm_buffers": 2 * buffer,
    }
    last_forward = {
        "unsharded_params": gathered,
        "activations": through_blocks,
        "comm_buffers": buffer,
    }
    root_end = {
        "unsharded_params": everything if keeps_all else root_bytes,
        "activations": base.activations,
        "comm_buffers": buffer,
    }
    return {
        "forward start": base.model_copy(update=start),
        "last block all-gather": base.model_copy(update=last_gather),
        "last block forward": base.model_copy(update=last_forward),
        "root forward end": base.model_copy(update=root_end),
    }


def _fsdp1_forward(
    base: MemoryBreakdown,
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    through_blocks: int,
) -> dict[str, MemoryBreakdown]:
    """FSDP1's forward moments (:func:`forward_moments`); ``base``: the loss's, without its
    temporaries."""
    everything, root_bytes, unit_bytes = _gathered_units(profile, candidate)
    keeps_all = traits(candidate).keeps_gathered
    mixed = candidate.precision.mixed
    gathers = shard_size(candidate, hardware) > 1 or mixed  # no copy: fp32 NO_SHARD
    held = everything if keeps_all else root_bytes if gathers else 0
    out = {
        "root forward end": base.model_copy(
            update={"unsharded_params": held, "activations": base.activations}
        )
    }
    # NO_SHARD under mixed precision makes a low-precision copy of each unit as it runs
    # forward, beside the root's (simulated: a LoRA Llama's peak in Lightning's order)
    copies = not traits(candidate).shards_params and mixed
    if (resharded_sharding(candidate) or copies) and not candidate.one_unit:
        out["last block forward"] = base.model_copy(
            update={"unsharded_params": root_bytes + unit_bytes, "activations": through_blocks}
        )
    return out


def loop_moments(
    moments: dict[str, MemoryBreakdown],
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    acts: ActivationProfile,
) -> dict[str, MemoryBreakdown]:
    """The moments the user's loop adds to those of one plain step (forward, backward, step,
    ``zero_grad(set_to_none=True)``), named apart.

    - Lightning's order zeroes the gradients after the next forward: that forward runs with the
      last step's (sharded) gradients allocated.
    - Accumulation: the later micro-batches run with the gradients of the earlier ones: kept
      unsharded when the sync is skipped (:func:`skips_gradient_sync`,
      :func:`no_sync_moments`), or reduced into the sharded gradients, which then stay
      allocated through every forward and backward (:func:`synced_accumulation_moments`)."""
    sharded_grads = moments["optimizer step"].gradients  # 0 when offloaded to the host
    forward = forward_moments(moments, profile, candidate, hardware, acts)
    out: dict[str, MemoryBreakdown] = {}
    # in every loop: no gradients are alive then
    out.update(
        backward_start_moments(
            moments["head backward"], "", moments, profile, candidate, hardware, acts
        )
    )
    # The forward's own moments, with no gradient alive: the peak where backward holds little
    # (frozen parameters, LoRA: no weight gradients).
    out.update({name: m for name, m in forward.items() if name != "forward end"})
    run = as_run(candidate, hardware)
    if run.engine is Engine.FSDP1 and shard_size(run, hardware) == 1 and not run.one_unit:
        # FSDP1 concatenates a unit's gradients into its flat gradient: the bottom block's
        # views and flat copy beside every other unit's gradient (measured on fake tensors)
        _, cb = element_bytes(run.precision)
        trained_unit = gradient_params(profile, run)[2]
        root_backward = moments["root backward"]
        out["bottom block's flat gradient"] = root_backward.model_copy(
            update={"gradients": root_backward.gradients + trained_unit * cb}
        )
    if workload.loop == Loop.LIGHTNING:
        alive = dict(forward)
        if candidate.engine is Engine.FSDP1:
            # zero_grad() sets the original parameters' gradients (views, use_orig_params=True
            # as trials and Lightning run it) to None, but the flat parameters' sharded
            # gradients live on until the root's pre-backward hook, which runs once the loss's
            # backward reaches the logits: the loss is computed beside them (measured on 2
            # gloo processes and on fake tensors, every sharding)
            alive["loss"] = moments["loss"]
        for name, m in alive.items():
            out[f"{name}, last step's gradients"] = m.model_copy(
                update={"gradients": m.gradients + sharded_grads}
            )
    if workload.accumulate == 1:
        return out
    if skips_gradient_sync(candidate, workload):
        out.update(no_sync_moments(moments, forward, profile, candidate, hardware, acts))
    else:
        out.update(
            synced_accumulation_moments(moments, forward, profile, candidate, hardware, acts)
        )
    return out
