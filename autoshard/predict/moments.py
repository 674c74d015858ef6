"""The moments of one training step that can hold a rank's memory peak, each a
:class:`~autoshard.results.MemoryBreakdown` of the step's byte counts
(:mod:`autoshard.predict.step_bytes`): the loss at the end of forward, the head's backward, the
blocks' backward (FSDP2 resharding: every block's, walked down the blocks,
:func:`blocks_backward`), the root's backward, the optimizer step, and with gloo each
reduce-scatter; the user's loop adds its own (:mod:`autoshard.predict.loop_moments`). The step's
timeline places each at the turn where it happens (:mod:`autoshard.predict.step_memory`).
Calibrated against torch's memory tracker on fake tensors (:mod:`autoshard.predict.simulate`).
"""

from __future__ import annotations

from autoshard.config import Candidate, Engine, Hardware, Reshard
from autoshard.engine import (
    as_run,
    element_bytes,
    policy_of,
    resharded_sharding,
    shard_size,
    traits,
)
from autoshard.predict.activations import ActivationProfile
from autoshard.predict.step_bytes import (
    StepBytes,
    after_blocks_bytes,
    block_saved_bytes,
    last_block_bytes,
)
from autoshard.results import MemoryBreakdown, ModelProfile


def block_event_names(index: int, blocks: int) -> tuple[str, ...]:
    """The names of block ``index``'s backward event, of ``blocks``: by its place from the top
    and from the bottom, as the report names the blocks where a peak usually is (with two
    blocks the bottom one is also the second)."""
    names = (
        ("top block backward",) * (index == blocks - 1)
        + ("second block backward",) * (index == blocks - 2)
        + ("block above the bottom backward",) * (index == 1 and blocks >= 4)
        + ("bottom block backward",) * (index == 0)
    )
    return names or (f"block {index} backward",)


def _loss_moment(t: StepBytes) -> MemoryBreakdown:
    """Moment 0, the loss at the end of forward."""
    # Several moments compete for the peak (measured with torch's tracker, design notes "Memory");
    # gradients are set to None after each step, so backward starts without any.
    # 0. The loss, at the end of forward: every activation saved; the logits, their shifted
    #    copy (or fp32 cast) and the log-probabilities alive together.
    #    A model that computes its loss in forward (a Hugging Face model given labels) has the
    #    root's backward hooks on the loss itself: the root is gathered and the last block
    #    prefetched before the loss's backward, beside its temporaries (simulated).
    early = t.acts.loss_in_forward and t.wrapped and resharded_sharding(t.candidate)
    loss_moment = MemoryBreakdown(
        sharded_params=t.param_shard_bytes,
        unsharded_params=(
            (
                t.root_params
                + (
                    t.block_params
                    if t.candidate.engine is Engine.FSDP1
                    else policy_of(t.candidate).keeps_after_forward(t.candidate, 0, t.block_params)
                )
            )
            * t.compute_dtype_bytes
            if early
            else t.kept_after_forward_bytes
        ),
        optimizer=t.optimizer_bytes,
        comm_buffers=t.gather_buffer_bytes if early else 0,
        activations=t.saved_bytes,
        temporaries=2 * t.logits_grad_bytes,
        buffers=t.profile.buffer_bytes,
    )
    return loss_moment


def _head_moment(t: StepBytes) -> MemoryBreakdown:
    """Moment 1, the head's backward."""
    # 1. The head's backward: the loss's backward is done (its log-probabilities freed), the
    #    logits' gradient alive, the root gathered again with the working set.
    #    FSDP2 gathers the last block into its all-gather buffer meanwhile (prefetched), and
    #    copies it out only when the block's backward starts (simulated).
    fsdp2_resharded = (
        t.candidate.engine is Engine.FSDP2 and t.wrapped and resharded_sharding(t.candidate)
    )
    head = MemoryBreakdown(
        sharded_params=t.param_shard_bytes,
        unsharded_params=(
            (
                t.root_params
                + policy_of(t.candidate).keeps_after_forward(t.candidate, 0, t.block_params)
            )
            * t.compute_dtype_bytes
            if fsdp2_resharded
            else t.gathered_bytes
        ),
        optimizer=t.optimizer_bytes,
        # no block has reduced its gradients yet
        comm_buffers=t.comm_bytes - t.trained_block_params * t.reduce_dtype_bytes,
        activations=t.saved_bytes - t.loss_saved_bytes,
        temporaries=t.logits_grad_bytes,
        buffers=t.profile.buffer_bytes,
    )
    return head


def _block_moments(t: StepBytes, head: MemoryBreakdown) -> tuple[MemoryBreakdown, bool]:
    """Moment 2, the top block's backward, and whether units are resharded after forward (the
    other blocks' moments count only then: :func:`blocks_backward`)."""
    # 2. The top block's backward: the block recomputes under checkpointing and makes its
    #    gradients.
    resharded = t.wrapped and resharded_sharding(t.candidate)
    if not t.wrapped:  # the one unit stays gathered through backward
        top_block = head.model_copy(update={"temporaries": t.block_backward_bytes})
    elif resharded:
        # The block being computed, the next one gathering into its all-gather buffer, and the
        # root, gathered from the head's backward until its own at the very end (simulated).
        top_block = head.model_copy(
            update={
                "unsharded_params": (t.block_params + t.root_params) * t.compute_dtype_bytes,
                "temporaries": t.block_backward(-1),
            }
        )
    elif traits(t.candidate).keeps_gathered:
        # the top block's parameters are freed once its gradients are reduced
        top_block = head.model_copy(
            update={
                "unsharded_params": t.gathered_bytes - t.block_params * t.compute_dtype_bytes,
                "temporaries": t.block_backward(-1),
            }
        )
    else:  # NO_SHARD: nothing is gathered or freed
        top_block = head.model_copy(update={"temporaries": t.block_backward(-1)})
    # it reduces its gradients; the head's gradient waits in the root (FSDP2), and what the
    # forward saved after the last block is freed: the head's backward has used it. FSDP1 keeps
    # counting those activations: it too holds the head's gradient through the blocks' backward
    # (in autograd's input buffer for the root's flat parameter, until the embedding's gradient
    # completes it), which its moments do not count: the activations stand in for it
    # (provenance: benchmarks/results/memory_moments.md).
    freed = after_blocks_bytes(t.candidate, t.acts) if t.candidate.engine is Engine.FSDP2 else 0
    top_block = top_block.model_copy(
        update={
            "comm_buffers": t.comm_bytes,
            "gradients": top_block.gradients + t.head_grad_bytes,
            "activations": top_block.activations - freed,
        }
    )
    if t.candidate.engine is Engine.FSDP1 and resharded:
        # FSDP1 keeps the root gathered until the root's own backward at the very end, and
        # gathers each unit straight into its flat parameter (no buffers); a unit's flat
        # gradient only appears when the unit's backward is done (the parameters' gradients
        # flow through views of the flat parameter), after its temporaries are freed (the
        # block gradient moments). The worst block but the top is the second: its own unit,
        # the first prefetched (simulated).
        top_block = top_block.model_copy(
            update={"unsharded_params": t.gathered_bytes, "comm_buffers": 0}
        )
    return top_block, resharded


def blocks_backward(t: StepBytes, top_block: MemoryBreakdown) -> list[MemoryBreakdown]:
    """Resharding after forward: every block's backward in the order it runs (from the top
    down; entry ``j`` is block ``blocks - 1 - j``), walked as a ledger from ``top_block``
    (:func:`_block_moments`' top block). Each block's turn frees what the block above saved and
    holds its own backward temporaries (recomputed where it is checkpointed), with the gradient
    shards of the blocks already reduced: FSDP2 every block above (a unit's reduce-scatter input
    held until the next unit's post-backward, ``comm_ctx.reduce_scatter_state``, beside the
    next block's all-gather buffer, prefetched; the top block holds no reduce-scatter input
    yet, the bottom one nothing to prefetch); FSDP1 all but the block just above, whose flat
    gradient is reduced after this block's turn starts (it gathers straight into the flat
    parameters: no buffers). Going down, each block holds one more gradient shard and one
    block's saved activations fewer: with few ranks the worst is near the bottom, with many near
    the top (simulated: gpt-deep's FSDP2 peak at micro-batch 2 is the second block's, a 4-block
    7B shape's in fp32 at 8 ranks the one above the bottom; provenance:
    benchmarks/results/memory_moments.md)."""
    blocks = max(t.profile.block_count, 1)
    fsdp2 = t.candidate.engine is Engine.FSDP2
    events = []
    activations = top_block.activations
    for index in reversed(range(blocks)):
        above = blocks - 1 - index  # blocks whose backward is done
        if above:  # the block above's backward freed what it saved
            activations -= block_saved_bytes(t.candidate, t.acts, index + 1)
        reduced = above if fsdp2 else max(above - 1, 0)
        reducing = t.trained_block_params * t.reduce_dtype_bytes if above else 0
        prefetched = t.gather_buffer_bytes if index > 0 else 0
        events.append(
            top_block.model_copy(
                update={
                    "gradients": top_block.gradients + t.block_grad_shard_bytes * reduced // blocks,
                    "activations": activations,
                    "temporaries": t.block_backward(index),
                    "comm_buffers": reducing + prefetched if fsdp2 else 0,
                }
            )
        )
    return events


def _root_backward_moment(t: StepBytes) -> tuple[MemoryBreakdown, bool]:
    """Moment 4, the root's backward, and whether FSDP1 holds the root gathered then."""
    # 4. The root's backward, at the very end: the embedding's gradient completes the root's
    #    unsharded gradient, which is reduced (cast to the reduce dtype) into its shard; every
    #    block's gradient is already sharded. FSDP1 still holds the root gathered; FSDP2 has
    #    resharded it. Both copy the gradient into a reduce-scatter input beside it (simulated:
    #    FSDP2 too, even when no cast is needed); NO_SHARD all-reduces in place unless it casts.
    gathered_root = t.candidate.engine is Engine.FSDP1 and traits(t.candidate).shards_params
    root_backward = MemoryBreakdown(
        sharded_params=t.param_shard_bytes,
        unsharded_params=t.root_params * t.compute_dtype_bytes
        if gathered_root or (t.mixed and t.shard == 1)
        else 0,
        gradients=t.block_grad_shard_bytes + t.trained_root_params * t.compute_dtype_bytes,
        optimizer=t.optimizer_bytes,
        comm_buffers=(
            t.trained_root_params * t.reduce_dtype_bytes
            if t.shard > 1 or t.reduce_dtype_bytes != t.compute_dtype_bytes
            else 0
        ),
        activations=int(t.acts.other_bytes * t.acts_scale),
        buffers=t.profile.buffer_bytes,
    )
    return root_backward, gathered_root


def _optimizer_step_moment(t: StepBytes) -> MemoryBreakdown:
    """Moment 5, the optimizer step."""
    # 5. The optimizer step: gradients and the foreach transient, no activations.
    step = MemoryBreakdown(
        sharded_params=t.param_shard_bytes,
        unsharded_params=t.frozen_root_bytes,
        gradients=t.grad_shard_bytes,
        optimizer=t.optimizer_bytes,
        temporaries=t.foreach_bytes,
        buffers=t.profile.buffer_bytes,
    )
    return step


def _reduce_scatter_moments(
    t: StepBytes,
    top_block: MemoryBreakdown,
    bottom_block: MemoryBreakdown,
    root_backward: MemoryBreakdown,
    resharded: bool,
    gathered_root: bool,
) -> dict[str, MemoryBreakdown]:
    """FSDP1's flat-gradient concatenation and gloo's reduce-scatter copies."""
    reduce_scatters = {}
    # gloo reduce-scatters a copy of its input (ProcessGroupGloo: +1x the input, measured around
    # a bare collective; NCCL works in place, all-reduce copies nothing).
    gloo_copy = t.hardware.backend == "gloo" and t.shard > 1
    if t.candidate.engine is Engine.FSDP1 and t.wrapped and t.shard > 1:
        # A unit's backward ends with its parameters' gradients concatenated into the flat
        # gradient (both alive), the unit still gathered (it is resharded next, then reduced):
        # the top block's activations are freed by then, the others' still saved; the bottom
        # block's are the last, with every other block's gradient in shards.
        gradient = {"temporaries": 0, "comm_buffers": 2 * t.block_params * t.reduce_dtype_bytes}
        reduce_scatters["top block gradient"] = top_block.model_copy(
            update={
                **gradient,
                "unsharded_params": t.gathered_bytes
                if resharded
                else t.params * t.compute_dtype_bytes,
                "activations": t.saved_bytes
                - t.loss_saved_bytes
                - last_block_bytes(t.candidate, t.acts),
            }
        )
        if resharded:
            reduce_scatters["bottom block gradient"] = bottom_block.model_copy(
                update={
                    **gradient,
                    "unsharded_params": (t.block_params + t.root_params) * t.compute_dtype_bytes,
                }
            )
    if gloo_copy:
        # Each copy lives while its unit's gradients are reduced: after the unit's backward
        # temporaries are freed (simulated with the copy).
        if t.wrapped:
            last = bottom_block if resharded else top_block
            reduce_scatters["block reduce-scatter"] = last.model_copy(
                update={
                    "temporaries": 0,
                    "comm_buffers": last.comm_buffers
                    + t.trained_block_params * t.reduce_dtype_bytes,
                }
            )
        reduce_scatters["root reduce-scatter"] = root_backward.model_copy(
            update={
                "unsharded_params": root_backward.unsharded_params
                - (
                    t.root_params * t.compute_dtype_bytes
                    if gathered_root and not t.frozen_root_bytes
                    else 0
                ),
                "comm_buffers": root_backward.comm_buffers
                + t.trained_root_params * t.reduce_dtype_bytes,
            }
        )
    return reduce_scatters


def step_moments(t: StepBytes) -> dict[str, MemoryBreakdown]:
    """The moments of one plain step (forward, backward, optimizer step) that can hold the
    peak, by name."""
    loss_moment = _loss_moment(t)
    head = _head_moment(t)
    top_block, resharded = _block_moments(t, head)
    # SHARD_GRAD_OP and NO_SHARD hold every unit all along: the top block is the worst
    blocks, bottom_block = {"top block backward": top_block}, top_block
    if resharded:
        walk = blocks_backward(t, top_block)
        bottom_block = walk[-1]
        blocks = {
            name: live
            for j, live in enumerate(walk)
            for name in block_event_names(len(walk) - 1 - j, len(walk))
        }
    root_backward, gathered_root = _root_backward_moment(t)
    step = _optimizer_step_moment(t)
    reduce_scatters = _reduce_scatter_moments(
        t, top_block, bottom_block, root_backward, resharded, gathered_root
    )
    return {
        "loss": loss_moment,
        "head backward": head,
        **blocks,
        "root backward": root_backward,
        "optimizer step": step,
        **reduce_scatters,
    }


def backward_start_moments(
    head: MemoryBreakdown,
    prefix: str,
    moments: dict[str, MemoryBreakdown],
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    acts: ActivationProfile,
) -> dict[str, MemoryBreakdown]:
    """The backward's start (:func:`backward_start_moment`, from the ``head`` backward moment)
    and gloo's held root (:func:`gloo_held_root_moment`), named with ``prefix``, where they
    are moments."""
    out = {}
    start = backward_start_moment(head, profile, candidate, hardware)
    if start is not None:
        out[f"{prefix}backward start"] = start
    saved = moments["loss"].activations
    held = gloo_held_root_moment(start, saved, profile, candidate, hardware, acts)
    if held is not None:
        out[f"{prefix}backward start, last block prefetched"] = held
    return out


def backward_start_moment(
    head: MemoryBreakdown, profile: ModelProfile, candidate: Candidate, hardware: Hardware
) -> MemoryBreakdown | None:
    """FSDP2 re-gathers a root it resharded after forward when backward starts: the root's
    all-gather buffer beside its copy, before the head's backward (measured on fake tensors).
    ``head`` is the head's backward moment; None where the root is not re-gathered."""
    candidate = as_run(candidate, hardware)
    if not (
        candidate.engine is Engine.FSDP2
        and resharded_sharding(candidate)
        and shard_size(candidate, hardware) > 1
        and candidate.reshard is Reshard.ALL
    ):
        return None
    _, cb = element_bytes(candidate.precision)
    root_params = profile.total_params if candidate.one_unit else profile.root_unit_params
    return head.model_copy(
        update={
            "unsharded_params": root_params * cb,
            "comm_buffers": root_params * cb,
            # the logits' gradient, cast back to the compute dtype by the loss's backward
            "temporaries": head.temporaries * cb // 4,
        }
    )


def gloo_held_root_moment(
    start: MemoryBreakdown | None,
    saved: int,
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    acts: ActivationProfile,
) -> MemoryBreakdown | None:
    """gloo: the root's pre-backward hook waits on the root's re-gather as soon as it is issued,
    copies it out and at once allocates the last block's all-gather (its prefetch). gloo's
    worker thread drops its reference to a collective's tensors only after it has woken the
    waiting thread, so the root's all-gather output can still be alive then: a race, the worst
    case planned here (measured on 2 gloo processes, a LoRA Llama: 4 ranks of 4 in fp32, 3 of 8
    in bf16; a 20 ms pause before the prefetch removes it, and torch's fake process group never
    holds it). The moment: ``start`` (the root gathered beside its all-gather buffer) with the
    last block's buffer and, under mixed precision, its shards cast to the compute dtype. A
    loss computed in forward carries the root's backward hook: every activation ``saved`` is
    still alive, the loss's backward has not run. None where ``start`` is None."""
    if start is None or hardware.backend != "gloo":
        return None
    candidate = as_run(candidate, hardware)
    if candidate.one_unit:
        return None
    _, cb = element_bytes(candidate.precision)
    unit_bytes = profile.block_params * cb
    mixed = candidate.precision.mixed
    cast = unit_bytes // shard_size(candidate, hardware) if mixed else 0
    update = {"comm_buffers": start.comm_buffers + unit_bytes + cast}
    if acts.loss_in_forward:
        update.update(activations=saved, temporaries=0)
    return start.model_copy(update=update)
