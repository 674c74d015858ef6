"""The rules of a micro-batch's backward events and of the optimizer step, by the turn of the
step's timeline they happen in (:mod:`autoshard.predict.step_memory` walks the turns, calls them
and adds the gradients carried in from before the micro-batch): the root re-gathered and the
head's backward at the root's backward turn, each block's backward at its turn (walked down the
blocks from the top, :func:`block_backward`), FSDP1's flat-gradient concatenation and gloo's
reduce-scatter copies at the turn that reduces, the root's backward at the root's gradient turn.
Each is a :class:`~autoshard.results.MemoryBreakdown` of the step's byte counts
(:class:`~autoshard.predict.step_bytes.StepBytes`). Calibrated against torch's memory tracker on
fake tensors (:mod:`autoshard.predict.simulate`).
"""

from __future__ import annotations

from autoshard.config import Engine
from autoshard.engine import policy_of, traits
from autoshard.predict.step_bytes import (
    StepBytes,
    after_blocks_bytes,
    block_saved_bytes,
    last_block_bytes,
)
from autoshard.results import MemoryBreakdown


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


def head_backward(t: StepBytes) -> MemoryBreakdown:
    """The head's backward: the loss's backward is done (its log-probabilities freed), the
    logits' gradient alive, the root gathered again with the working set. FSDP2 gathers the
    last block into its all-gather buffer meanwhile (prefetched), and copies it out only when
    the block's backward starts (simulated)."""
    prefetches = t.engine is Engine.FSDP2 and t.reshards_blocks
    unsharded = t.backward_start_unsharded_bytes if prefetches else t.gathered_bytes
    # FSDP1 offloading: the head's weight gradient is made while the logits' gradient is alive
    # (emulated, op by op; the trackers the other events are calibrated with snapshot at module
    # boundaries, between the two)
    offloaded = t.engine is Engine.FSDP1 and t.candidate.cpu_offload
    return MemoryBreakdown(
        gradients=fsdp1_head_gradient(t) if offloaded else 0,
        sharded_params=t.param_shard_bytes,
        unsharded_params=unsharded,
        optimizer=t.optimizer_bytes,
        # no block has reduced its gradients yet
        comm_buffers=t.comm_bytes - t.trained_block_params * t.reduce_dtype_bytes,
        activations=t.saved_bytes - t.loss_saved_bytes,
        temporaries=t.logits_grad_bytes,
        buffers=t.profile.buffer_bytes,
    )


def backward_start(t: StepBytes, head: MemoryBreakdown) -> MemoryBreakdown | None:
    """FSDP2 re-gathers a root it resharded after forward when backward starts: the root's
    all-gather buffer beside its copy, before the head's backward (measured on fake tensors).
    ``head`` is the head's backward event of the same micro-batch; None where the root is not
    re-gathered."""
    # the timeline's rule for the root's backward turn (FSDP1 never reshards the root)
    if not (t.shard > 1 and policy_of(t.candidate).regathers(t.candidate, root=True)):
        return None
    root = t.root_params * t.compute_dtype_bytes
    return head.model_copy(
        update={
            "unsharded_params": root,
            "comm_buffers": root,
            # the logits' gradient, cast back to the compute dtype by the loss's backward
            "temporaries": head.temporaries * t.compute_dtype_bytes // 4,
        }
    )


def gloo_held_root(t: StepBytes, start: MemoryBreakdown | None) -> MemoryBreakdown | None:
    """gloo: the root's pre-backward hook waits on the root's re-gather as soon as it is issued,
    copies it out and at once allocates the last block's all-gather (its prefetch). gloo's
    worker thread drops its reference to a collective's tensors only after it has woken the
    waiting thread, so the root's all-gather output can still be alive then: a race, the worst
    case planned here (measured on 2 gloo processes, a LoRA Llama: 4 ranks of 4 in fp32, 3 of 8
    in bf16; a 20 ms pause before the prefetch removes it, and torch's fake process group never
    holds it). The event: ``start`` (the root gathered beside its all-gather buffer) with the
    last block's buffer and, under mixed precision, its shards cast to the compute dtype. A
    loss computed in forward carries the root's backward hook: every activation saved is
    still alive, the loss's backward has not run. None where ``start`` is None."""
    if start is None or t.hardware.backend != "gloo" or t.candidate.one_unit:
        return None
    unit = t.profile.block_params * t.compute_dtype_bytes
    cast = unit // t.shard if t.mixed else 0
    update = {"comm_buffers": start.comm_buffers + unit + cast}
    if t.acts.loss_in_forward:
        update.update(activations=t.saved_bytes, temporaries=0)
    return start.model_copy(update=update)


def top_block_backward(t: StepBytes, head: MemoryBreakdown) -> MemoryBreakdown:
    """The top block's backward (or the one unit's), after the ``head``'s: the block
    recomputes under checkpointing and makes its gradients."""
    if not t.wrapped:  # the one unit stays gathered through backward
        top = head.model_copy(update={"temporaries": t.block_backward_bytes})
    elif t.reshards_blocks:
        # The block being computed, the next one gathering into its all-gather buffer, and the
        # root, gathered from the head's backward until its own at the very end (simulated).
        top = head.model_copy(
            update={
                "unsharded_params": (t.block_params + t.root_params) * t.compute_dtype_bytes,
                "temporaries": t.block_backward(-1),
            }
        )
    elif traits(t.candidate).keeps_gathered:
        # the top block's parameters are freed once its gradients are reduced
        top = head.model_copy(
            update={
                "unsharded_params": t.gathered_bytes - t.block_params * t.compute_dtype_bytes,
                "temporaries": t.block_backward(-1),
            }
        )
    else:  # NO_SHARD: nothing is gathered or freed
        top = head.model_copy(update={"temporaries": t.block_backward(-1)})
        if t.block_copies_bytes:  # offloaded: the root's second copy freed by the head's backward
            top = top.model_copy(update={"unsharded_params": t.block_copies_bytes})
    # It reduces its gradients; the head's gradient waits in the root (FSDP2: in its unsharded
    # gradient; FSDP1: in autograd's input buffer for the root's flat parameter, until the
    # embedding's gradient completes it), and what the forward saved after the last block is
    # freed: the head's backward has used it (provenance: benchmarks/results/memory_moments.md).
    top = top.model_copy(
        update={
            "comm_buffers": t.comm_bytes,
            "gradients": top.gradients + t.head_grad_bytes + fsdp1_head_gradient(t),
            "activations": top.activations - after_blocks_bytes(t.candidate, t.acts),
        }
    )
    if t.engine is Engine.FSDP1 and t.reshards_blocks:
        # FSDP1 keeps the root gathered until the root's own backward at the very end, and
        # gathers each unit straight into its flat parameter (no buffers); a unit's flat
        # gradient only appears when the unit's backward is done (the parameters' gradients
        # flow through views of the flat parameter), after its temporaries are freed (the
        # block gradient events). The worst block but the top is the second: its own unit,
        # the first prefetched (simulated).
        top = top.model_copy(update={"unsharded_params": t.gathered_bytes, "comm_buffers": 0})
    return top


def fsdp1_head_gradient(t: StepBytes) -> int:
    """FSDP1 with block units: the head's gradient in autograd's input buffer for the root's
    flat parameter (one gradient per view, gathered when the embedding's completes them), from
    the head's backward through every block's (simulated: 0.49 GiB in fp32 on a 7B shape);
    0 for FSDP2 (:attr:`StepBytes.head_grad_bytes`), one unit or a frozen root."""
    if t.engine is not Engine.FSDP1 or not t.wrapped:
        return 0
    return min(t.head_params, t.trained_root_params) * t.compute_dtype_bytes


def block_backward(
    t: StepBytes, top: MemoryBreakdown, index: int, activations: int
) -> MemoryBreakdown:
    """Resharding after forward: block ``index``'s backward, one step of the walk down the
    blocks from the ``top`` block's event, with ``activations`` still saved (the walk frees what
    each block above saved). It holds its own backward temporaries (recomputed where it is
    checkpointed), with the gradient shards of the blocks already reduced: FSDP2 every block
    above (a unit's reduce-scatter input held until the next unit's post-backward,
    ``comm_ctx.reduce_scatter_state``, beside the next block's all-gather buffer, prefetched;
    the top block holds no reduce-scatter input yet, the bottom one nothing to prefetch); FSDP1
    all but the block just above, whose flat gradient is reduced after this block's turn starts
    (it gathers straight into the flat parameters: no buffers). Going down, each block holds one
    more gradient shard and one block's saved activations fewer: with few ranks the worst is
    near the bottom, with many near the top (simulated: gpt-deep's FSDP2 peak at micro-batch 2
    is the second block's, a 4-block 7B shape's in fp32 at 8 ranks the one above the bottom;
    provenance: benchmarks/results/memory_moments.md)."""
    blocks = max(t.profile.block_count, 1)
    fsdp2 = t.engine is Engine.FSDP2
    above = blocks - 1 - index  # blocks whose backward is done
    reduced = above if fsdp2 else max(above - 1, 0)
    reducing = t.trained_block_params * t.reduce_dtype_bytes if above else 0
    prefetched = t.gather_buffer_bytes if index > 0 else 0
    return top.model_copy(
        update={
            "gradients": top.gradients + t.block_grad_shard_bytes * reduced // blocks,
            "activations": activations,
            "temporaries": t.block_backward(index),
            "comm_buffers": reducing + prefetched if fsdp2 else 0,
        }
    )


def freed_by_block(t: StepBytes, index: int) -> int:
    """What block ``index``'s backward frees of the activations: what it saved in forward."""
    return block_saved_bytes(t.candidate, t.acts, index)


def fsdp1_flat_gradient(
    t: StepBytes, block: MemoryBreakdown, *, top: bool
) -> MemoryBreakdown | None:
    """FSDP1, sharded: a unit's backward ends with its parameters' gradients concatenated into
    the flat gradient (both alive), the unit still gathered (it is resharded next, then
    reduced), after ``block``'s event: at the ``top`` block the top block's activations are
    freed, the others' still saved; at the bottom block (resharding only) they are the last,
    with every other block's gradient in shards. None where there is no such event."""
    if not (t.engine is Engine.FSDP1 and t.wrapped and t.shard > 1):
        return None
    if not top and not t.reshards_blocks:
        return None
    update = {"temporaries": 0, "comm_buffers": 2 * t.block_params * t.reduce_dtype_bytes}
    if top:
        everything = t.params * t.compute_dtype_bytes
        saved = t.saved_bytes - t.loss_saved_bytes - last_block_bytes(t.candidate, t.acts)
        saved -= after_blocks_bytes(t.candidate, t.acts)  # the head's backward freed them
        update |= {
            "unsharded_params": t.gathered_bytes if t.reshards_blocks else everything,
            "activations": saved,
        }
    else:
        update |= {"unsharded_params": (t.block_params + t.root_params) * t.compute_dtype_bytes}
    return block.model_copy(update=update)


def gloo_copies(t: StepBytes) -> bool:
    """gloo reduce-scatters a copy of its input (ProcessGroupGloo: +1x the input, measured
    around a bare collective; NCCL works in place, all-reduce copies nothing)."""
    return t.hardware.backend == "gloo" and t.shard > 1


def gloo_block_reduce_scatter(t: StepBytes, last: MemoryBreakdown) -> MemoryBreakdown | None:
    """gloo's copy of the ``last`` block's reduce input, alive while its gradients are reduced:
    after the unit's backward temporaries are freed (simulated with the copy)."""
    if not (gloo_copies(t) and t.wrapped):
        return None
    return last.model_copy(
        update={
            "temporaries": 0,
            "comm_buffers": last.comm_buffers + t.trained_block_params * t.reduce_dtype_bytes,
        }
    )


def root_gathered_at_backward(t: StepBytes) -> bool:
    """Whether the root is still gathered at its own backward (FSDP1 never reshards it after
    forward; FSDP2 has)."""
    return t.engine is Engine.FSDP1 and traits(t.candidate).shards_params


def root_backward(t: StepBytes) -> MemoryBreakdown:
    """The root's backward, at the very end: the embedding's gradient completes the root's
    unsharded gradient, which is reduced (cast to the reduce dtype) into its shard; every
    block's gradient is already sharded. FSDP1 still holds the root gathered; FSDP2 has
    resharded it. Both copy the gradient into a reduce-scatter input beside it (simulated:
    FSDP2 too, even when no cast is needed); NO_SHARD all-reduces in place unless it casts."""
    gathered = root_gathered_at_backward(t) or (t.mixed and t.shard == 1)
    copies = t.shard > 1 or t.reduce_dtype_bytes != t.compute_dtype_bytes
    root = t.root_params * t.compute_dtype_bytes if gathered else 0
    return MemoryBreakdown(
        sharded_params=t.param_shard_bytes,
        unsharded_params=root + t.root_copy_bytes,
        gradients=t.block_grad_shard_bytes + t.trained_root_params * t.compute_dtype_bytes,
        optimizer=t.optimizer_bytes,
        comm_buffers=t.trained_root_params * t.reduce_dtype_bytes if copies else 0,
        activations=int(t.acts.other_bytes * t.acts_scale),
        buffers=t.profile.buffer_bytes,
    )


def gloo_root_reduce_scatter(t: StepBytes, root: MemoryBreakdown) -> MemoryBreakdown | None:
    """gloo's copy of the root's reduce input, after the ``root`` backward event (the root
    resharded by then unless it is frozen)."""
    if not gloo_copies(t):
        return None
    resharded = root_gathered_at_backward(t) and not t.frozen_root_bytes
    return root.model_copy(
        update={
            "unsharded_params": root.unsharded_params
            - (t.root_params * t.compute_dtype_bytes if resharded else 0),
            "comm_buffers": root.comm_buffers + t.trained_root_params * t.reduce_dtype_bytes,
        }
    )


def fsdp1_unsharded_flat_gradient(t: StepBytes, root: MemoryBreakdown) -> MemoryBreakdown | None:
    """FSDP1 at one shard concatenates a unit's gradients into its flat gradient: the bottom
    block's views and flat copy beside every other unit's gradient, after the ``root``'s
    backward (measured on fake tensors)."""
    if not (t.engine is Engine.FSDP1 and t.shard == 1 and t.wrapped):
        return None
    flat = t.trained_block_params * t.compute_dtype_bytes
    return root.model_copy(update={"gradients": root.gradients + flat})


def fsdp1_offloaded_root_gradient(t: StepBytes, root: MemoryBreakdown) -> MemoryBreakdown | None:
    """FSDP1 offloading: the root's backward ends with autograd concatenating its parameters'
    gradients (one per view: the head's, the embedding's) into the root's flat gradient, both
    alive, beside every block's gradient still on the device (emulated: FSDP1's offload on CPU
    processes, :mod:`autoshard.predict.offload_emulation`). Without offload the same moment
    holds less than the optimizer step's states and foreach copy, and is not counted; None
    where nothing is offloaded or the root is sharded."""
    if not (t.engine is Engine.FSDP1 and t.candidate.cpu_offload and t.wrapped and t.shard == 1):
        return None  # sharded, the root's reduce-scatter input is counted as that copy
    pieces = t.trained_root_params * t.compute_dtype_bytes
    return root.model_copy(update={"gradients": root.gradients + pieces})


def optimizer_step(t: StepBytes) -> MemoryBreakdown:
    """The optimizer step: gradients and the foreach transient, no activations."""
    return MemoryBreakdown(
        sharded_params=t.param_shard_bytes,
        unsharded_params=t.frozen_root_bytes,
        gradients=t.grad_shard_bytes,
        optimizer=t.optimizer_bytes,
        temporaries=t.foreach_bytes,
        buffers=t.profile.buffer_bytes,
    )
