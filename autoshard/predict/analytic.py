"""Analytic per-rank memory of an FSDP candidate: pure arithmetic after one activation profile
(:mod:`autoshard.predict.activations`).

The per-rank peak is the largest of the moments of a training step, each a sum of terms (see
``../shared/design.md``, "Memory", and :func:`peak_moments`): the loss at the end of forward,
the head's backward, the top, second (FSDP2) and bottom blocks' backward, the root's backward,
the optimizer step, and with gloo each reduce-scatter. The terms:
- sharded parameters, gradients and optimizer states: ``P x bytes / shard_size``;
- the unsharded working set: the unit being computed and the prefetched next one (2 x largest
  unit in the compute dtype) and the root unit, or the whole model for SHARD_GRAD_OP (no
  reshard after forward);
- communication buffers: the reduce-scatter input of one unit in the reduce dtype;
- activations saved for backward, by the checkpointing choice; the loss's fp32 log-probabilities;
- temporaries: the logits and their gradient, one block's recomputed activations and gradients,
  the foreach optimizer's transient copy of the shard;
- buffers, and an allowance for what a CPU cannot see (CUDA context, NCCL, allocator slack).
Calibrated against torch's memory tracker on fake tensors (:mod:`autoshard.simulate`) and
checked against measured runs by ``benchmarks/estimate_accuracy.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.config import (
    Candidate,
    Checkpointing,
    Engine,
    Hardware,
    Loop,
    Optimizer,
    OptimizerImpl,
    Precision,
    Reshard,
    Sharding,
    WorkloadSpec,
)
from autoshard.engine import (
    OPTIMIZER_STATES,
    as_run,
    element_bytes,
    gradient_params,
    policy_of,
    reduce_bytes,
    resharded_sharding,
    shard_size,
    skips_gradient_sync,
)
from autoshard.predict.activations import ActivationProfile, rule_of_thumb
from autoshard.results import MemoryBreakdown, MemoryEstimate, ModelProfile

__all__ = [
    "accumulated_gradient_bytes",
    "allowance",
    "as_run",
    "estimate_all",
    "estimate_memory",
    "gradient_params",
    "needs_simulation",
    "peak_moments",
    "skips_gradient_sync",
]

# What a CPU cannot see on a GPU: the CUDA context and cuBLAS workspace (about 0.5-1 GiB on
# recent GPUs), NCCL's buffers, and the caching allocator's reserved-over-allocated slack.
# Uncalibrated until a GPU run measures it (benchmarks/results/), so stated as an allowance.
CUDA_CONTEXT_BYTES = 1 * 1024**3
ALLOCATOR_SLACK = 0.05


def allowance(subtotal: int, hardware: Hardware) -> int:
    """What a CPU cannot see on a GPU, for a peak of ``subtotal`` counted bytes; nothing for CPU
    processes (gloo), where there is no CUDA context or caching allocator."""
    if hardware.backend == "gloo":
        return 0
    return CUDA_CONTEXT_BYTES + int(subtotal * ALLOCATOR_SLACK)


def activation_bytes(candidate: Candidate, acts: ActivationProfile) -> tuple[int, int]:
    """(saved activations, recompute transient) for the candidate's micro-batch, in bytes."""
    acts = acts.at(candidate.precision)
    scale = acts.scale(candidate)
    blocks, inputs = acts.block_bytes, acts.block_input_bytes
    saved = sum(
        (inputs[i] if i < len(inputs) else 0) if candidate.checkpoints(i) else b
        for i, b in enumerate(blocks)
    )
    # one checkpointed block's activations are rebuilt at a time in backward
    checkpointing = candidate.checkpointing is not Checkpointing.NONE
    recompute = max(blocks, default=0) if checkpointing else 0
    loss = candidate.micro_batch_size * acts.loss_bytes
    return int((saved + acts.other_bytes) * scale) + loss, int(recompute * scale)


def last_block_bytes(candidate: Candidate, acts: ActivationProfile) -> int:
    """What the last block saved in forward (its input under checkpointing): freed when its
    backward is done."""
    acts = acts.at(candidate.precision)
    if not acts.block_bytes:
        return 0
    ckpt = candidate.checkpointing is not Checkpointing.NONE
    last = acts.block_input_bytes[-1] if ckpt and acts.block_input_bytes else acts.block_bytes[-1]
    return int(last * acts.scale(candidate))


def after_blocks_bytes(candidate: Candidate, acts: ActivationProfile) -> int:
    """What the forward saved after the last block (the final norm's and the head's inputs, in
    :attr:`ActivationProfile.other_bytes`): the head's backward frees it, before any block's
    backward starts."""
    acts = acts.at(candidate.precision)
    return int(acts.after_blocks_bytes * acts.scale(candidate))


def first_block_bytes(candidate: Candidate, acts: ActivationProfile) -> int:
    """What is still saved when the first block runs its backward: its own activations (its
    input under checkpointing) and what was saved before it (the embedding's)."""
    acts = acts.at(candidate.precision)
    scale = acts.scale(candidate)
    if not acts.block_bytes:
        return int(acts.other_bytes * scale)
    ckpt = candidate.checkpointing is not Checkpointing.NONE
    first = acts.block_input_bytes[0] if ckpt and acts.block_input_bytes else acts.block_bytes[0]
    return int((first + acts.other_bytes) * scale)


@dataclass(frozen=True)
class _StepTerms:
    """The byte counts every moment of a training step is made of (one rank, before the
    allowance), computed once by :func:`_step_terms` for :func:`peak_moments`."""

    candidate: Candidate
    profile: ModelProfile
    hardware: Hardware
    workload: WorkloadSpec
    acts: ActivationProfile
    uniform: ActivationProfile
    stored: int
    cb: int
    params: int
    shard: int
    wrapped: bool
    unit: int
    root: int
    mixed: bool
    trained: int
    trained_root: int
    trained_unit: int
    sharded: int
    grads: int
    states: int
    one_state: int
    optimizer: int
    unsharded: int
    after_forward: int
    fp32_reduce: bool
    reduce_bytes: int
    gather: int
    comm: int
    saved: int
    recompute: int
    loss_saved: int
    scale: float
    block_grad: int
    block_backward: int
    logits: int
    foreach: int
    block_grads: int
    frozen_root: int
    head_grad: int
    host: int


def _step_terms(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    acts: ActivationProfile,
) -> _StepTerms:
    """What the moments share: the candidate as run, the parameter, gradient and optimizer bytes
    of one rank (nothing of those on the GPU when offloaded; ``host`` then), the gathered units,
    the collectives' buffers, and the activations at the candidate's precision."""
    candidate = as_run(candidate, hardware)
    stored, cb = element_bytes(candidate.precision)
    params = profile.total_params
    shard = shard_size(candidate, hardware)
    # Without a wrap policy the whole model is one (root) unit: no block units to prefetch.
    wrapped = not candidate.one_unit
    unit = max(profile.block_params, 1) if wrapped else 0
    root = profile.root_unit_params if wrapped else params
    mixed = candidate.precision.mixed

    # Frozen parameters carry no gradient and no optimizer state (gradient_params).
    trained, trained_root, trained_unit = gradient_params(profile, candidate)
    sharded = params * stored // shard
    grads = trained * stored // shard
    states = OPTIMIZER_STATES[candidate.optimizer]
    one_state = policy_of(candidate).state_bytes(profile, candidate, shard)  # of one rank
    optimizer = states * one_state

    if candidate.sharding is Sharding.SHARD_GRAD_OP:
        unsharded = params * cb  # kept gathered from forward to backward
        after_forward = unsharded
    elif candidate.sharding is Sharding.NO_SHARD and candidate.engine is Engine.FSDP2:
        # FSDP2 replicates on a (world, 1) mesh and still gathers copies, in every precision:
        # the root and the current unit (measured on fake tensors; nothing is prefetched)
        unsharded = (unit + root) * cb if wrapped else params * cb
        after_forward = 0
    elif candidate.sharding is Sharding.NO_SHARD:
        # low-precision copies of the current unit and the prefetched one (or of the one unit)
        unsharded = ((2 * unit if wrapped else params) * cb) if mixed else 0
        # A loss computed in the root's forward (a Hugging Face model given labels) runs
        # beside FSDP1's low-precision copy of the root, freed when the root's forward ends
        # (simulated: a LoRA Llama, 5% low without it; a loss outside the model runs without)
        in_root = mixed and candidate.engine is Engine.FSDP1 and acts.loss_in_forward
        after_forward = root * cb if in_root else 0
    else:
        unsharded = (2 * unit + root) * cb  # current + prefetched unit, and the root
        # When the loss is computed, FSDP1 keeps the root gathered from forward into backward;
        # FSDP2 keeps what its reshard policy keeps (the root, the last block), nothing with ALL.
        after_forward = (
            root * cb
            if candidate.engine is Engine.FSDP1
            else policy_of(candidate).keeps_after_forward(candidate, root, unit) * cb
        )
    # Lightning's FSDP1 reduces in the compute dtype; FSDP2 here reduces in fp32 when mixed.
    reduce = reduce_bytes(candidate)
    fp32_reduce = reduce != cb
    # the reduce-scatter input of one unit, and (resharding after forward) the next unit's
    # all-gather output: FSDP2 gathers into a buffer and copies each unit out of it; FSDP1
    # gathers straight into the unit's padded flat parameter (counted as unsharded).
    gather = 0
    if shard > 1 and candidate.engine is Engine.FSDP2:
        if not wrapped:
            gather = params * cb  # the one unit, copied out of its all-gather buffer
        elif candidate.sharding is not Sharding.SHARD_GRAD_OP:
            gather = unit * cb
    comm = trained_unit * reduce + gather

    # The gradients of a block's activations are made in the compute dtype, also where the
    # forward saved an fp32 upcast: sized from the fp32 profile when there is one.
    uniform = acts.at(Precision.FP32)
    acts = acts.at(candidate.precision)
    saved, recompute = activation_bytes(candidate, acts)
    loss_saved = candidate.micro_batch_size * acts.loss_bytes
    scale = acts.scale(candidate)
    block_grad = int(max(uniform.block_bytes, default=0) * uniform.scale(candidate))
    # A block's backward turns its saved activations into gradients as it goes: the moment holds
    # the larger of the two, not both. Under checkpointing the block first recomputes them, and
    # the peak comes about halfway through its backward (fitted to the simulation of a 7B shape
    # at 8 and 64 ranks: within 9% on both engines, where both in full was +18% and the larger
    # of the two -11%).
    if candidate.checkpointing is Checkpointing.NONE:
        block_backward = max(0, block_grad - int(max(acts.block_bytes, default=0) * scale))
    else:
        block_backward = recompute + block_grad // 2
    logits = 0
    if profile.vocab_size and workload.seq_len:
        # the logits' gradient in fp32 (cross-entropy)
        logits = candidate.micro_batch_size * workload.seq_len * profile.vocab_size * 4
    foreach = (
        one_state
        if candidate.optimizer_impl is OptimizerImpl.FOREACH
        and candidate.optimizer is not Optimizer.SGD
        else 0
    )

    # the blocks' gradients, reduced to shards
    block_grads = (trained - trained_root) * stored // shard
    # FSDP1 never reshards a root unit that does not train (no gradient, so no post-backward
    # hook): once gathered by the first forward it stays gathered (measured on fake tensors,
    # a LoRA Llama whose embedding and head are frozen).
    frozen_root = (
        root * cb
        if candidate.engine is Engine.FSDP1 and wrapped and shard > 1 and not trained_root
        else 0
    )
    # FSDP2 reduces a unit's gradients in its post-backward hook, and the root's runs last: the
    # head's gradient, made first in backward, waits unsharded in the root through every block's
    # backward (simulated, torch 2.13: the 2 MiB head gradient of gpt-deep alive at the second
    # block's peak; without it the analytic estimate was 5.7% below a measured gloo run). FSDP1's
    # gradients flow into views of the root's flat parameter, allocated when its backward ends.
    head_grad = fsdp2_head_gradient(profile, candidate)
    host = 0
    if candidate.cpu_offload:
        # parameters, gradients and optimizer state live in host memory; the GPU keeps the
        # working set only
        host = (sharded + grads + optimizer) * hardware.gpus_per_node
        sharded = grads = optimizer = foreach = block_grads = 0
    return _StepTerms(
        candidate=candidate,
        profile=profile,
        hardware=hardware,
        workload=workload,
        acts=acts,
        uniform=uniform,
        stored=stored,
        cb=cb,
        params=params,
        shard=shard,
        wrapped=wrapped,
        unit=unit,
        root=root,
        mixed=mixed,
        trained=trained,
        trained_root=trained_root,
        trained_unit=trained_unit,
        sharded=sharded,
        grads=grads,
        states=states,
        one_state=one_state,
        optimizer=optimizer,
        unsharded=unsharded,
        after_forward=after_forward,
        fp32_reduce=fp32_reduce,
        reduce_bytes=reduce,
        gather=gather,
        comm=comm,
        saved=saved,
        recompute=recompute,
        loss_saved=loss_saved,
        scale=scale,
        block_grad=block_grad,
        block_backward=block_backward,
        logits=logits,
        foreach=foreach,
        block_grads=block_grads,
        frozen_root=frozen_root,
        head_grad=head_grad,
        host=host,
    )


def _loss_moment(t: _StepTerms) -> MemoryBreakdown:
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
        sharded_params=t.sharded,
        unsharded_params=(
            (
                t.root
                + (
                    t.unit
                    if t.candidate.engine is Engine.FSDP1
                    else policy_of(t.candidate).keeps_after_forward(t.candidate, 0, t.unit)
                )
            )
            * t.cb
            if early
            else t.after_forward
        ),
        optimizer=t.optimizer,
        comm_buffers=t.gather if early else 0,
        activations=t.saved,
        temporaries=2 * t.logits,
        buffers=t.profile.buffer_bytes,
    )
    return loss_moment


def _head_moment(t: _StepTerms) -> MemoryBreakdown:
    """Moment 1, the head's backward."""
    # 1. The head's backward: the loss's backward is done (its log-probabilities freed), the
    #    logits' gradient alive, the root gathered again with the working set.
    #    FSDP2 gathers the last block into its all-gather buffer meanwhile (prefetched), and
    #    copies it out only when the block's backward starts (simulated, torch 2.13).
    fsdp2_resharded = (
        t.candidate.engine is Engine.FSDP2
        and t.wrapped
        and t.candidate.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
    )
    head = MemoryBreakdown(
        sharded_params=t.sharded,
        unsharded_params=(
            (t.root + policy_of(t.candidate).keeps_after_forward(t.candidate, 0, t.unit)) * t.cb
            if fsdp2_resharded
            else t.unsharded
        ),
        optimizer=t.optimizer,
        # no block has reduced its gradients yet
        comm_buffers=t.comm - t.trained_unit * t.reduce_bytes,
        activations=t.saved - t.loss_saved,
        temporaries=t.logits,
        buffers=t.profile.buffer_bytes,
    )
    return head


def _block_moments(
    t: _StepTerms, head: MemoryBreakdown
) -> tuple[MemoryBreakdown, MemoryBreakdown, bool]:
    """Moments 2 and 3, the top and the bottom block's backward, and whether units are
    resharded after backward (the bottom block's moment counts only then)."""
    # 2. The top block's backward: the block recomputes under checkpointing and makes its
    #    gradients.
    resharded = t.wrapped and t.candidate.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
    if not t.wrapped:  # the one unit stays gathered through backward
        top_block = head.model_copy(update={"temporaries": t.block_backward})
    elif resharded:
        # The block being computed, the next one gathering into its all-gather buffer, and the
        # root, gathered from the head's backward until its own at the very end (torch 2.13,
        # simulated: FSDP2 holds the root and one block unsharded during the blocks' backward).
        top_block = head.model_copy(
            update={
                "unsharded_params": (t.unit + t.root) * t.cb,
                "temporaries": t.block_backward,
            }
        )
    elif t.candidate.sharding is Sharding.SHARD_GRAD_OP:
        # the top block's parameters are freed once its gradients are reduced
        top_block = head.model_copy(
            update={
                "unsharded_params": t.unsharded - t.unit * t.cb,
                "temporaries": t.block_backward,
            }
        )
    else:  # NO_SHARD: nothing is gathered or freed
        top_block = head.model_copy(update={"temporaries": t.block_backward})
    # it reduces its gradients; the head's gradient waits in the root (FSDP2), and what the
    # forward saved after the last block is freed: the head's backward has used it. FSDP1 keeps
    # counting those activations: it too holds the head's gradient through the blocks' backward
    # (in autograd's input buffer for the root's flat parameter, until the embedding's gradient
    # completes it; simulated, torch 2.13: 250 MiB on the bf16 7B shape), which its moments do
    # not count, and the activations (192 MiB there) stand in for it.
    freed = after_blocks_bytes(t.candidate, t.acts) if t.candidate.engine is Engine.FSDP2 else 0
    top_block = top_block.model_copy(
        update={
            "comm_buffers": t.comm,
            "gradients": top_block.gradients + t.head_grad,
            "activations": top_block.activations - freed,
        }
    )
    # 3. The bottom block's backward: the other blocks' activations are freed and their
    #    gradients reduced into shards; the root (the embedding) is prefetched in place of a
    #    next block. (SHARD_GRAD_OP holds everything all along: the top block is worse.)
    blocks = max(t.profile.block_count, 1)
    bottom_block = top_block.model_copy(
        update={
            "unsharded_params": (t.unit + t.root) * t.cb,
            # every block's gradient in shards but its own
            "gradients": t.block_grads * (blocks - 1) // blocks + t.head_grad,
            "activations": first_block_bytes(t.candidate, t.acts) - freed,
            # the block above's reduce-scatter; nothing left to prefetch (the root is gathered)
            "comm_buffers": t.comm - t.gather if t.wrapped else t.comm,
        }
    )
    if t.candidate.engine is Engine.FSDP1 and resharded:
        # FSDP1 keeps the root gathered until the root's own backward at the very end, and a
        # unit's flat gradient only appears when the unit's backward is done (the parameters'
        # gradients flow through views of the flat parameter), after its temporaries are freed
        # (the block gradient moments). The worst block but the top is the second: its own
        # unit, the first prefetched (simulated, torch 2.13).
        top_block = top_block.model_copy(
            update={"unsharded_params": t.unsharded, "comm_buffers": 0}
        )
        bottom_block = bottom_block.model_copy(
            update={
                "unsharded_params": t.unsharded,
                "comm_buffers": 0,
                "gradients": t.block_grads * max(blocks - 2, 0) // blocks,
            }
        )
    return top_block, bottom_block, resharded


def _fsdp2_second_block_moment(
    t: _StepTerms, top_block: MemoryBreakdown
) -> tuple[MemoryBreakdown, MemoryBreakdown | None]:
    """FSDP2 keeps a unit's reduce-scatter input alive until the next unit's post-backward
    (``comm_ctx.reduce_scatter_state``), so the top block's backward holds only the next block's
    all-gather buffer, and the second block's the top block's reduce-scatter input and reduced
    shard beside it, with the top block's activations freed (simulated, torch 2.13: gpt-deep's
    peak at micro-batch 2 is the second block's backward). Returns the top block's moment and
    the second block's (None with fewer than two blocks); other candidates keep
    :func:`_block_moments`' moment, which counts both collectives' buffers."""
    resharded = t.wrapped and resharded_sharding(t.candidate)
    if t.candidate.engine is not Engine.FSDP2 or not resharded:
        return top_block, None
    blocks = t.profile.block_count
    prefetched = t.gather if blocks > 1 else 0  # the next block's all-gather buffer
    top = top_block.model_copy(update={"comm_buffers": prefetched})
    if blocks < 2:
        return top, None
    second = top_block.model_copy(
        update={
            "gradients": top_block.gradients + t.block_grads // blocks,
            "activations": top_block.activations - last_block_bytes(t.candidate, t.acts),
            "comm_buffers": t.trained_unit * t.reduce_bytes + (t.gather if blocks > 2 else 0),
        }
    )
    return top, second


def _fsdp2_above_bottom_moment(
    t: _StepTerms, bottom_block: MemoryBreakdown
) -> MemoryBreakdown | None:
    """FSDP2's backward of the block above the bottom one: :func:`_block_moments`' bottom block
    moment, with the bottom block's all-gather buffer (prefetched) beside the reduce-scatter
    input of the block above, one block's gradient fewer in shards, and one block's saved
    activations more. Going down the blocks, each holds one more block's gradient shard and one
    block's saved activations fewer than the one above: where a gradient shard outweighs a
    checkpointed block's input (few ranks), the worst block is this one, not the second from
    the top (simulated, torch 2.13: a 4-block 7B shape at 8 ranks in fp32 peaks in block 1's
    backward, 97 MiB shards against 64 MiB inputs). None for other candidates and with fewer
    than four blocks (three: it is the second block from the top)."""
    blocks = t.profile.block_count
    if (
        t.candidate.engine is not Engine.FSDP2
        or not (t.wrapped and resharded_sharding(t.candidate))
        or blocks < 4
    ):
        return None
    return bottom_block.model_copy(
        update={
            "gradients": bottom_block.gradients - t.block_grads // blocks,
            "activations": bottom_block.activations + _block_saved_bytes(t.candidate, t.acts, 1),
            "comm_buffers": t.trained_unit * t.reduce_bytes + t.gather,
        }
    )


def _block_saved_bytes(candidate: Candidate, acts: ActivationProfile, index: int) -> int:
    """What block ``index`` saved in forward, by the candidate's checkpointing (its input where
    it is checkpointed): freed when its backward is done."""
    acts = acts.at(candidate.precision)
    if index >= len(acts.block_bytes):
        return 0
    inputs = acts.block_input_bytes
    saved = (
        (inputs[index] if index < len(inputs) else 0)
        if candidate.checkpoints(index)
        else acts.block_bytes[index]
    )
    return int(saved * acts.scale(candidate))


def _root_backward_moment(t: _StepTerms) -> tuple[MemoryBreakdown, bool]:
    """Moment 4, the root's backward, and whether FSDP1 holds the root gathered then."""
    # 4. The root's backward, at the very end: the embedding's gradient completes the root's
    #    unsharded gradient, which is reduced (cast to the reduce dtype) into its shard; every
    #    block's gradient is already sharded. FSDP1 still holds the root gathered; FSDP2 has
    #    resharded it. Both copy the gradient into a reduce-scatter input beside it (simulated:
    #    FSDP2 too, even when no cast is needed); NO_SHARD all-reduces in place unless it casts.
    gathered_root = (
        t.candidate.engine is Engine.FSDP1 and t.candidate.sharding is not Sharding.NO_SHARD
    )
    root_backward = MemoryBreakdown(
        sharded_params=t.sharded,
        unsharded_params=t.root * t.cb if gathered_root or (t.mixed and t.shard == 1) else 0,
        gradients=t.block_grads + t.trained_root * t.cb,
        optimizer=t.optimizer,
        comm_buffers=(
            t.trained_root * t.reduce_bytes if t.shard > 1 or t.reduce_bytes != t.cb else 0
        ),
        activations=int(t.acts.other_bytes * t.scale),
        buffers=t.profile.buffer_bytes,
    )
    return root_backward, gathered_root


def _optimizer_step_moment(t: _StepTerms) -> MemoryBreakdown:
    """Moment 5, the optimizer step."""
    # 5. The optimizer step: gradients and the foreach transient, no activations.
    step = MemoryBreakdown(
        sharded_params=t.sharded,
        unsharded_params=t.frozen_root,
        gradients=t.grads,
        optimizer=t.optimizer,
        temporaries=t.foreach,
        buffers=t.profile.buffer_bytes,
    )
    return step


def _reduce_scatter_moments(
    t: _StepTerms,
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
        gradient = {"temporaries": 0, "comm_buffers": 2 * t.unit * t.reduce_bytes}
        reduce_scatters["top block gradient"] = top_block.model_copy(
            update={
                **gradient,
                "unsharded_params": t.unsharded if resharded else t.params * t.cb,
                "activations": t.saved - t.loss_saved - last_block_bytes(t.candidate, t.acts),
            }
        )
        if resharded:
            reduce_scatters["bottom block gradient"] = bottom_block.model_copy(
                update={**gradient, "unsharded_params": (t.unit + t.root) * t.cb}
            )
    if gloo_copy:
        # Each copy lives while its unit's gradients are reduced: after the unit's backward
        # temporaries are freed (simulated with the copy).
        if t.wrapped:
            last = bottom_block if resharded else top_block
            reduce_scatters["block reduce-scatter"] = last.model_copy(
                update={
                    "temporaries": 0,
                    "comm_buffers": last.comm_buffers + t.trained_unit * t.reduce_bytes,
                }
            )
        reduce_scatters["root reduce-scatter"] = root_backward.model_copy(
            update={
                "unsharded_params": root_backward.unsharded_params
                - (t.root * t.cb if gathered_root and not t.frozen_root else 0),
                "comm_buffers": root_backward.comm_buffers + t.trained_root * t.reduce_bytes,
            }
        )
    return reduce_scatters


def peak_moments(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    acts: ActivationProfile,
) -> tuple[dict[str, MemoryBreakdown], int]:
    """The per-rank bytes at each moment that can hold the peak of a training step (before the
    allowance), and the host bytes per node.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec
    >>> from autoshard import analyze_target, peak_moments, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> workload = WorkloadSpec(seq_len=128, loop="plain")  # zero_grad after step
    >>> candidate = Candidate(wrap_classes=profile.wrap_policy)
    >>> gpus = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30)
    >>> acts = profile_activations(built.model, profile, workload)
    >>> moments, host = peak_moments(profile, candidate, gpus, workload, acts)
    >>> for moment in moments:
    ...     print(moment)
    loss
    head backward
    top block backward
    bottom block backward
    root backward
    optimizer step
    top block gradient
    bottom block gradient
    root forward end
    last block forward
    >>> host  # nothing offloaded
    0
    >>> trainer = WorkloadSpec(seq_len=128, loop="lightning")  # zero_grad before backward
    >>> lightning, _ = peak_moments(profile, candidate, gpus, trainer, acts)
    >>> for moment in sorted(lightning.keys() - moments):  # the last step's gradients alive
    ...     print(moment)
    forward end, last step's gradients
    last block forward, last step's gradients
    loss, last step's gradients
    root forward end, last step's gradients
    """
    t = _step_terms(profile, candidate, hardware, workload, acts)
    loss_moment = _loss_moment(t)
    head = _head_moment(t)
    top_block, bottom_block, resharded = _block_moments(t, head)
    top_alone, second_block = _fsdp2_second_block_moment(t, top_block)
    above_bottom = _fsdp2_above_bottom_moment(t, bottom_block)
    root_backward, gathered_root = _root_backward_moment(t)
    step = _optimizer_step_moment(t)
    reduce_scatters = _reduce_scatter_moments(
        t, top_block, bottom_block, root_backward, resharded, gathered_root
    )
    moments = {
        "loss": loss_moment,
        "head backward": head,
        "top block backward": top_alone,
        **({"second block backward": second_block} if second_block is not None else {}),
        **({"bottom block backward": bottom_block} if resharded else {}),
        **({"block above the bottom backward": above_bottom} if above_bottom is not None else {}),
        "root backward": root_backward,
        "optimizer step": step,
        **reduce_scatters,
    }
    moments.update(loop_moments(moments, profile, t.candidate, hardware, workload, t.acts))
    return moments, t.host


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
    scale = at.scale(candidate)
    saved = loss.activations
    through_blocks = saved - candidate.micro_batch_size * at.loss_bytes
    last = int(at.block_bytes[-1] * scale) if at.block_bytes else 0
    params = profile.total_params
    one_unit = candidate.one_unit
    unit = 0 if one_unit else profile.block_params * cb
    root = params * cb if one_unit else profile.root_unit_params * cb
    keeps_all = candidate.sharding is Sharding.SHARD_GRAD_OP
    base = loss.model_copy(update={"temporaries": 0})
    if candidate.engine is Engine.FSDP2:
        gathered = params * cb if keeps_all or one_unit else root + unit
        buffer = 0 if shard_size(candidate, hardware) == 1 else (unit or root)
        # The forward's start: every unit was resharded after the last backward; the root is
        # gathered (its all-gather buffer beside its copy) as the first block is prefetched.
        gathering = root + unit
        out["forward start"] = base.model_copy(
            update={
                "unsharded_params": gathering,
                "activations": 0,
                "comm_buffers": 0 if shard_size(candidate, hardware) == 1 else gathering,
            }
        )
        out["last block all-gather"] = base.model_copy(
            update={
                "unsharded_params": gathered,
                "activations": through_blocks - last,
                "comm_buffers": 2 * buffer,
            }
        )
        out["last block forward"] = base.model_copy(
            update={
                "unsharded_params": gathered,
                "activations": through_blocks,
                "comm_buffers": buffer,
            }
        )
        out["root forward end"] = base.model_copy(
            update={
                "unsharded_params": params * cb if keeps_all else root,
                "activations": saved,
                "comm_buffers": buffer,
            }
        )
    else:
        mixed = candidate.precision.mixed
        gathers = shard_size(candidate, hardware) > 1 or mixed  # no copy: fp32 NO_SHARD
        out["root forward end"] = base.model_copy(
            update={
                "unsharded_params": params * cb if keeps_all else root if gathers else 0,
                "activations": saved,
            }
        )
        # NO_SHARD under mixed precision makes a low-precision copy of each unit as it runs
        # forward, beside the root's (simulated: a LoRA Llama's peak in Lightning's order)
        copies = candidate.sharding is Sharding.NO_SHARD and mixed
        if (
            candidate.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD) or copies
        ) and not one_unit:
            out["last block forward"] = base.model_copy(
                update={"unsharded_params": root + unit, "activations": through_blocks}
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
    start = backward_start_moment(moments["head backward"], profile, candidate, hardware)
    if start is not None:  # in every loop: no gradients are alive then
        out["backward start"] = start
    saved = moments["loss"].activations
    held = gloo_held_root_moment(start, saved, profile, candidate, hardware, acts)
    if held is not None:
        out["backward start, last block prefetched"] = held
    # The forward's own moments, with no gradient alive: the peak where backward holds little
    # (frozen parameters, LoRA: no weight gradients).
    out.update({name: m for name, m in forward.items() if name != "forward end"})
    run = as_run(candidate, hardware)
    if run.engine is Engine.FSDP1 and shard_size(run, hardware) == 1 and not run.one_unit:
        # FSDP1 concatenates a unit's gradients into its flat gradient: the bottom block's
        # views and flat copy beside every other unit's gradient (measured on fake tensors)
        _, cb = element_bytes(run.precision)
        trained_unit = gradient_params(profile, run)[2]
        root = moments["root backward"]
        out["bottom block's flat gradient"] = root.model_copy(
            update={"gradients": root.gradients + trained_unit * cb}
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


def accumulated_gradient_bytes(
    profile: ModelProfile, candidate: Candidate, hardware: Hardware
) -> int:
    """Bytes of the unsharded gradients kept between micro-batches when the sync is skipped:
    FSDP1 keeps each unit's whole flat gradient in the compute dtype; FSDP2 keeps each
    parameter's in the reduce dtype (fp32 under mixed precision with an fp32 reduce)."""
    candidate = as_run(candidate, hardware)
    return policy_of(candidate).accumulated_gradient_bytes(profile, candidate)


def fsdp2_head_gradient(profile: ModelProfile, candidate: Candidate) -> int:
    """Bytes of the head's unsharded gradient that FSDP2 holds in the root unit from the head's
    backward until the root's post-backward, after every block's (0 for FSDP1, without block
    units, or when the head is frozen). ``candidate`` as run (:func:`as_run`)."""
    if candidate.engine is not Engine.FSDP2 or candidate.one_unit:
        return 0
    _, cb = element_bytes(candidate.precision)
    _, trained_root, _ = gradient_params(profile, candidate)
    return min(_head_params(profile), trained_root) * cb


def _head_params(profile: ModelProfile) -> int:
    """Parameters of the output head (vocabulary x hidden), whose gradient is made first in
    backward and waits in the root unit until the root's backward ends; 0 without one."""
    if profile.vocab_size and profile.hidden_size and profile.root_unit_params:
        return min(profile.vocab_size * profile.hidden_size, profile.root_unit_params)
    return 0


def no_sync_moments(
    moments: dict[str, MemoryBreakdown],
    forward: dict[str, MemoryBreakdown],
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    acts: ActivationProfile,
) -> dict[str, MemoryBreakdown]:
    """Accumulation with the sync skipped (FSDP1 ``no_sync``, FSDP2
    ``set_requires_gradient_sync(False)``): every micro-batch after the first runs forward and
    backward beside the unsharded gradients of all the units that train
    (:func:`accumulated_gradient_bytes`); only the last reduces them.

    Measured on fake tensors (torch 2.13): a non-final micro-batch's block backward holds its
    unit's fresh gradients beside the kept ones until they are added in (FSDP1 also
    concatenates its unit's gradients into a flat one: twice the unit; FSDP2 under mixed
    precision upcasts them to fp32 first), and the head's gradient, which waits in the root
    unit; FSDP1 keeps the root gathered until the root's backward ends, FSDP2 re-gathers it at
    backward's start with the prefetched unit's all-gather buffer beside it. No reduce-scatter
    runs in these micro-batches. The last micro-batch reduces the top block with every other
    unit's gradients still unsharded."""
    candidate = as_run(candidate, hardware)
    _, cb = element_bytes(candidate.precision)
    kept = accumulated_gradient_bytes(profile, candidate, hardware)
    _, trained_root, trained_unit = gradient_params(profile, candidate)
    mixed = candidate.precision.mixed
    upcast = candidate.engine is Engine.FSDP2 and mixed and candidate.reduce_dtype_fp32
    at = acts.at(candidate.precision)
    scale = at.scale(candidate)
    last = int(at.block_bytes[-1] * scale) if at.block_bytes else 0
    head = moments["head backward"]
    through_blocks = head.activations  # saved, less the loss's log-probabilities
    one_unit = candidate.one_unit
    unit = 0 if one_unit else profile.block_params
    root = profile.total_params if one_unit else profile.root_unit_params
    gathers = shard_size(candidate, hardware) > 1 or mixed
    # the head's gradient waits in the root unit for its flat gradient (FSDP1) or its upcast
    # (FSDP2 mixed); FSDP2 without an upcast adds it into the kept gradient at once
    waits = candidate.engine is Engine.FSDP1 or upcast
    head_grad = _head_params(profile) * cb if trained_root and waits else 0

    def fresh(n: int) -> int:  # a unit's new gradients before they join the kept ones
        if candidate.engine is Engine.FSDP1:
            return 2 * n * cb
        # FSDP2 without an upcast: autograd adds into the kept gradient in place
        return n * cb + n * 4 if upcast else 0

    out = {
        f"accumulating {name}": m.model_copy(update={"gradients": m.gradients + kept})
        for name, m in {**forward, "loss": moments["loss"]}.items()
    }
    # The head's backward: its weight's fresh gradient (one tensor) beside the logits' gradient
    # before it joins the kept one; FSDP2 holds the root gathered, also with NO_SHARD.
    fsdp2_root = root * cb if candidate.engine is Engine.FSDP2 else 0
    head_kept = head.model_copy(
        update={
            "gradients": head.gradients + kept,
            "unsharded_params": max(head.unsharded_params, fsdp2_root),
        }
    )
    out["accumulating head backward"] = head_kept.model_copy(
        update={
            "temporaries": head.temporaries + (_head_params(profile) * cb if trained_root else 0)
        }
    )
    if candidate.engine is Engine.FSDP1:
        gathered_units = (root + 2 * unit) * cb if gathers else 0
        buffers = 0
    else:
        gathered_units = (root + unit) * cb if gathers else 0
        buffers = unit * cb if shard_size(candidate, hardware) > 1 else 0
    keeps_all = candidate.sharding is Sharding.SHARD_GRAD_OP
    if keeps_all:
        gathered_units = profile.total_params * cb  # nothing is freed between micro-batches
    base = head.model_copy(update={"comm_buffers": 0, "temporaries": 0, "gradients": kept})
    if not one_unit:
        out["accumulating block backward"] = base.model_copy(
            update={
                "unsharded_params": gathered_units,
                "comm_buffers": buffers,
                "activations": through_blocks - last,
                "temporaries": head_grad + fresh(trained_unit),
            }
        )
    out["accumulating root backward"] = base.model_copy(
        update={
            "unsharded_params": gathered_units if keeps_all else root * cb if gathers else 0,
            "activations": int(at.other_bytes * scale),
            "temporaries": fresh(trained_root),
        }
    )
    start = backward_start_moment(head_kept, profile, candidate, hardware)
    if start is not None:
        out["accumulating backward start"] = start
    saved = moments["loss"].activations
    held = gloo_held_root_moment(start, saved, profile, candidate, hardware, acts)
    if held is not None:
        out["accumulating backward start, last block prefetched"] = held
    # The last micro-batch: the top block reduces its gradients (and gloo copies the reduce
    # input) while every other unit's are still unsharded.
    top = moments["top block backward"]
    if "second block backward" in moments:  # FSDP2 holds the block above's reduce-scatter input
        top = top.model_copy(update={"comm_buffers": moments["second block backward"].comm_buffers})
    # FSDP1 reduce-scatters the unit's flat gradient itself, one of the kept ones
    own = trained_unit * reduce_bytes(candidate) if candidate.engine is Engine.FSDP1 else 0
    # the head's gradient is one of the kept ones
    gradients = top.gradients - fsdp2_head_gradient(profile, candidate) + kept
    sync = top.model_copy(
        update={"gradients": gradients, "comm_buffers": max(0, top.comm_buffers - own)}
    )
    out["synchronising top block backward"] = sync
    if candidate.engine is Engine.FSDP1 and not one_unit and not keeps_all:
        out.update(_fsdp1_synchronising_blocks(sync, profile, candidate, hardware, acts, kept))
    if hardware.backend == "gloo" and shard_size(candidate, hardware) > 1:
        out["synchronising block reduce-scatter"] = sync.model_copy(
            update={
                "temporaries": 0,
                "comm_buffers": sync.comm_buffers + trained_unit * reduce_bytes(candidate),
            }
        )
    return out


def _fsdp1_synchronising_blocks(
    sync: MemoryBreakdown,
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    acts: ActivationProfile,
    kept: int,
) -> dict[str, MemoryBreakdown]:
    """FSDP1's last micro-batch after ``no_sync``: each block, once its backward is done,
    reduces its kept (unsharded, compute-dtype) flat gradient into its stored gradient (NO_SHARD:
    cast to the parameters' dtype, the whole unit) while the blocks below still keep theirs. The
    worst block is where the stored gradients above outgrow the activations freed (simulated,
    torch 2.13: a LoRA Llama's second block under NO_SHARD bf16-mixed, 5.6% above the top)."""
    stored, cb = element_bytes(candidate.precision)
    shard = shard_size(candidate, hardware)
    _, _, trained_unit = gradient_params(profile, candidate)
    at = acts.at(candidate.precision)
    scale = at.scale(candidate)
    mixed = candidate.precision.mixed
    gathers = shard > 1 or mixed
    root = profile.root_unit_params
    unit = profile.block_params
    blocks = max(profile.block_count, 1)
    reduced = trained_unit * stored // shard  # one unit's stored gradient
    worst: MemoryBreakdown | None = None
    freed = 0
    for j in range(blocks):
        freed += int(at.block_bytes[blocks - 1 - j] * scale) if j < len(at.block_bytes) else 0
        moment = sync.model_copy(
            update={
                # FSDP1 keeps the root gathered; the block and the next one prefetched
                "unsharded_params": (root + (2 if j < blocks - 1 else 1) * unit) * cb
                if gathers
                else 0,
                "gradients": kept + j * (reduced - trained_unit * cb),
                "activations": max(0, sync.activations - freed),
                "comm_buffers": 0,
                "temporaries": reduced,  # the block's own, beside its kept one
            }
        )
        if worst is None or moment.total > worst.total:
            worst = moment
    return {} if worst is None else {"synchronising block backward": worst}


def _last_block_all_activations(candidate: Candidate, acts: ActivationProfile) -> int:
    # Everything the last block saves without checkpointing, whatever the candidate's
    # checkpointing (unlike last_block_bytes, which is the block's input under checkpointing).
    at = acts.at(candidate.precision)
    return int(at.block_bytes[-1] * at.scale(candidate)) if at.block_bytes else 0


def synced_accumulation_moments(
    moments: dict[str, MemoryBreakdown],
    forward: dict[str, MemoryBreakdown],
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    acts: ActivationProfile,
) -> dict[str, MemoryBreakdown]:
    """Accumulation without skipping the sync (Lightning's Trainer with FSDP2): every
    micro-batch reduces into the sharded gradients, which stay allocated through the later
    micro-batches' forwards and backwards. FSDP2 re-gathers the root at backward's start: its
    all-gather buffer beside the copy, with the sharded gradients alive (measured on fake
    tensors)."""
    candidate = as_run(candidate, hardware)
    stored, cb = element_bytes(candidate.precision)
    shard = shard_size(candidate, hardware)
    sharded_grads = moments["optimizer step"].gradients
    _, trained_root, trained_unit = gradient_params(profile, candidate)
    block_grads = moments["optimizer step"].gradients - trained_root * stored // shard
    reduce = reduce_bytes(candidate)
    out = {
        f"accumulating {name}": m.model_copy(update={"gradients": m.gradients + sharded_grads})
        for name, m in forward.items()
    }
    for name, m in moments.items():
        if name == "optimizer step":
            continue
        # the moment's unsharded gradients beside every unit's sharded ones (a reduce-scatter
        # output is added in after the collective, past the moment's peak)
        # (FSDP2's head gradient, waiting unsharded in the root, is one of them)
        waiting = min(fsdp2_head_gradient(profile, candidate), m.gradients)
        unsharded_grads = (
            max(0, m.gradients - waiting - block_grads) + waiting if sharded_grads else m.gradients
        )
        out[f"accumulating {name}"] = m.model_copy(
            update={"gradients": sharded_grads + unsharded_grads}
        )
    start = backward_start_moment(out["accumulating head backward"], profile, candidate, hardware)
    if start is not None:
        out["accumulating backward start"] = start
    saved = moments["loss"].activations
    held = gloo_held_root_moment(start, saved, profile, candidate, hardware, acts)
    if held is not None:
        out["accumulating backward start, last block prefetched"] = held
    if candidate.engine is Engine.FSDP2 and not candidate.one_unit:
        # The second block from the top: its fresh gradients and the top block's reduce-scatter
        # input beside the head's gradient waiting in the root (measured on fake tensors).
        head = moments["head backward"]
        block = profile.block_params * cb
        out["accumulating block backward"] = head.model_copy(
            update={
                "gradients": sharded_grads + trained_unit * reduce // shard,
                "unsharded_params": (profile.root_unit_params + profile.block_params) * cb,
                "comm_buffers": block if shard > 1 else 0,
                "activations": head.activations - 2 * _last_block_all_activations(candidate, acts),
                "temporaries": _head_params(profile) * cb * (trained_root > 0)
                + trained_unit * (cb + reduce),
            }
        )
    if candidate.engine is Engine.FSDP2 and candidate.sharding in (
        Sharding.NO_SHARD,
        Sharding.HYBRID_SHARD,
    ):
        # With a replicate dimension every unit's reduced gradients wait until backward ends
        # before they are added into the sharded ones (measured on fake tensors: a second set
        # of gradients builds up through backward).
        step = moments["optimizer step"]
        unit = 0 if candidate.one_unit else profile.block_params
        root = profile.total_params if candidate.one_unit else profile.root_unit_params
        out["accumulating backward end"] = step.model_copy(
            update={
                "unsharded_params": (root + unit) * cb,  # FSDP2 gathers copies, also at 1 shard
                "gradients": sharded_grads
                + gradient_params(profile, candidate)[0] * reduce // shard,
                "temporaries": 0,
                "activations": moments["root backward"].activations,
            }
        )
        m = out["accumulating root backward"]
        waiting = (gradient_params(profile, candidate)[0] - trained_root) * reduce // shard
        out["accumulating root backward, reduced gradients waiting"] = m.model_copy(
            update={"gradients": m.gradients + waiting}
        )
    if candidate.engine is Engine.FSDP2 and shard == 1 and reduce == cb:
        # FSDP2 copies the gradients into a reduce-scatter input even over a shard dimension
        # of 1 (NO_SHARD replicates on a (world, 1) mesh), then all-reduces; peak_moments
        # counts that copy only where it casts
        for name in ("accumulating root backward",):
            m = out[name]
            out[name] = m.model_copy(
                update={"comm_buffers": m.comm_buffers + trained_root * reduce}
            )
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
        and candidate.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
        and shard_size(candidate, hardware) > 1
        and candidate.reshard is Reshard.ALL
    ):
        return None
    _, cb = element_bytes(candidate.precision)
    root = profile.total_params if candidate.one_unit else profile.root_unit_params
    return head.model_copy(
        update={
            "unsharded_params": root * cb,
            "comm_buffers": root * cb,
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
    unit = profile.block_params * cb
    mixed = candidate.precision.mixed
    cast = unit // shard_size(candidate, hardware) if mixed else 0
    update = {"comm_buffers": start.comm_buffers + unit + cast}
    if acts.loss_in_forward:
        update.update(activations=saved, temporaries=0)
    return start.model_copy(update=update)


def needs_simulation(
    profile: ModelProfile, candidate: Candidate, workload: WorkloadSpec
) -> str | None:
    """Why the analytic estimate of ``candidate`` would be a guess, in one line, or None when
    it is modelled (and checked by ``benchmarks/estimate_accuracy.py``). Where it returns a
    reason, estimate by simulation (:func:`autoshard.predict.simulate.simulate_memory`) or, for
    CPU offload, which cannot be simulated on a CPU, by a trial.

    >>> from autoshard import Candidate, WorkloadSpec, analyze_model
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    >>> model[0].requires_grad_(False)  # doctest: +ELLIPSIS
    Linear(...)
    >>> profile = analyze_model(model)
    >>> needs_simulation(profile, Candidate(), WorkloadSpec()) is None
    True
    >>> needs_simulation(profile, Candidate(min_num_params=10), WorkloadSpec())[:46]
    'frozen parameters under a size-based wrap poli'
    """
    if candidate.optimizer not in OPTIMIZER_STATES:
        return (
            f"the analytic estimate does not know the state of optimizer "
            f"{candidate.optimizer.value!r}; simulate it"
        )
    if workload.loop not in (Loop.LIGHTNING, Loop.PLAIN):
        return f"the training loop {workload.loop.value!r} is not modelled; simulate it"
    if (
        profile.frozen_params
        and candidate.engine is Engine.FSDP1
        and not candidate.one_unit
        and not candidate.wrap_classes
    ):
        return (
            "frozen parameters under a size-based wrap policy: which FSDP1 units train (and so "
            "hold a full flat gradient) is not known before wrapping; simulate it"
        )
    if workload.accumulate > 1 and candidate.cpu_offload:
        return (
            "gradient accumulation with CPU offload is not modelled (where the kept gradients "
            "live depends on the engine); measure it with a trial"
        )
    if workload.accumulate > 1 and candidate.sharding is Sharding.HYBRID_SHARD:
        return (
            "gradient accumulation with HYBRID_SHARD is not checked against a measurement; "
            "simulate it"
        )
    return None


def estimate_memory(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    activations: ActivationProfile | None = None,
) -> MemoryEstimate:
    """Predict the per-rank GPU peak and per-node host memory of ``candidate``.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec
    >>> from autoshard import analyze_target, estimate_memory, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> workload = WorkloadSpec(seq_len=128)
    >>> acts = profile_activations(built.model, profile, workload)
    >>> gpus = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30)
    >>> full = estimate_memory(profile, Candidate(wrap_classes=profile.wrap_policy), gpus,
    ...                        workload, activations=acts)
    >>> full.method, full.fits, full.gpu_peak == full.breakdown.total
    ('analytic', True, True)
    >>> replicated = estimate_memory(
    ...     profile, Candidate(wrap_classes=profile.wrap_policy, sharding="NO_SHARD"), gpus,
    ...     workload, activations=acts)
    >>> replicated.breakdown.optimizer == 8 * full.breakdown.optimizer  # AdamW, 8 ranks
    True
    """
    acts = activations or rule_of_thumb(profile, workload, "no activation profile given")
    moments, host = peak_moments(profile, candidate, hardware, workload, acts)
    peak_at, breakdown = max(moments.items(), key=lambda item: item[1].total)
    breakdown = breakdown.model_copy(update={"allowance": allowance(breakdown.total, hardware)})
    peak = breakdown.total
    usable = hardware.usable_gpu_memory
    reasons = []
    if peak > usable:
        reasons.append(f"needs {peak / 2**30:.1f} GiB per GPU, {usable / 2**30:.1f} GiB usable")
    if hardware.host_memory is not None and host > hardware.host_memory:
        reasons.append(f"needs {host / 2**30:.1f} GiB of host memory per node")
    return MemoryEstimate(
        candidate=candidate,
        method="analytic",
        peak_at=peak_at,
        gpu_peak=peak,
        host_peak=host,
        breakdown=breakdown,
        fits=not reasons,
        headroom=usable - peak,
        reason="; ".join(reasons),
    )


def estimate_all(
    profile: ModelProfile,
    candidates: Sequence[Candidate],
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    activations: ActivationProfile | None = None,
) -> list[MemoryEstimate]:
    """Estimate every candidate (milliseconds each).

    >>> from autoshard import Hardware, TargetSpec, WorkloadSpec, analyze_target
    >>> from autoshard import enumerate_candidates, estimate_all, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> gpus = Hardware(gpus_per_node=8, gpu_memory=2 * 2**30)
    >>> workload = WorkloadSpec(seq_len=128)
    >>> candidates = enumerate_candidates(profile, gpus, workload, micro_batch_sizes=(1, 256))
    >>> acts = profile_activations(built.model, profile, workload)
    >>> estimates = estimate_all(profile, candidates, gpus, workload, activations=acts)
    >>> 0 < sum(e.fits for e in estimates) < len(candidates)  # some of micro-batch 256 overflow
    True
    """
    return [
        estimate_memory(profile, c, hardware, workload, activations=activations) for c in candidates
    ]
