"""The byte counts the memory moments of a training step are made of (one rank, before the
allowance; :mod:`autoshard.predict.step_memory`): sharded parameters, gradients and optimizer state
(:func:`step_bytes`), the gathered units, the collectives' buffers, and the activations a forward
saves and a backward frees, at the candidate's precision and micro-batch. Parameter counts are
named ``*_params``, byte counts ``*_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from autoshard.config import (
    Candidate,
    Checkpointing,
    Engine,
    Hardware,
    Precision,
    WorkloadSpec,
)
from autoshard.engine import (
    OffloadCopies,
    as_run,
    element_bytes,
    gradient_params,
    optimizer_bytes,
    policy_of,
    reduce_bytes,
    shard_size,
    traits,
)
from autoshard.predict.activations import ActivationProfile
from autoshard.results import ModelProfile


def activation_bytes(candidate: Candidate, acts: ActivationProfile) -> tuple[int, int]:
    """(saved activations, recompute transient) for the candidate's micro-batch, in bytes."""
    acts = acts.at(candidate.precision)
    scale = acts.scale(candidate)
    blocks = acts.block_bytes
    saved = sum(_block_saved(candidate, acts, i) for i in range(len(blocks)))
    # one checkpointed block's activations are rebuilt at a time in backward
    checkpointing = candidate.checkpointing is not Checkpointing.NONE
    recompute = max(blocks, default=0) if checkpointing else 0
    if candidate.checkpointing is Checkpointing.SELECTIVE and acts.selective_recomputed_bytes:
        recompute = max(acts.selective_recomputed_bytes)  # what the policy did not keep
    loss = candidate.micro_batch_size * acts.loss_bytes
    return int((saved + acts.other_bytes) * scale) + loss, int(recompute * scale)


def last_block_bytes(candidate: Candidate, acts: ActivationProfile) -> int:
    """What the last block saved in forward (its input where it is checkpointed): freed when
    its backward is done."""
    return block_saved_bytes(candidate, acts, len(acts.at(candidate.precision).block_bytes) - 1)


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
    if candidate.checkpointing is Checkpointing.SELECTIVE:
        first = _block_saved(candidate, acts, 0)
    return int((first + acts.other_bytes) * scale)


def block_saved_bytes(candidate: Candidate, acts: ActivationProfile, index: int) -> int:
    """What block ``index`` saved in forward, by the candidate's checkpointing (its input where
    it is checkpointed): freed when its backward is done."""
    acts = acts.at(candidate.precision)
    if not 0 <= index < len(acts.block_bytes):
        return 0
    return int(_block_saved(candidate, acts, index) * acts.scale(candidate))


def _block_saved(candidate: Candidate, acts: ActivationProfile, index: int) -> int:
    """Per profiled sample, what block ``index`` keeps from its forward to its backward: all
    it saves; its input where checkpointed; its input and the outputs the op-level policy saves
    under selective checkpointing (all it saves where those were not counted)."""
    if not candidate.checkpoints(index):
        return acts.block_bytes[index]
    if candidate.checkpointing is Checkpointing.SELECTIVE:
        kept = acts.selective_saved_bytes
        return kept[index] if index < len(kept) else acts.block_bytes[index]
    inputs = acts.block_input_bytes
    return inputs[index] if index < len(inputs) else 0


def last_block_all_activations(candidate: Candidate, acts: ActivationProfile) -> int:
    # Everything the last block saves without checkpointing, whatever the candidate's
    # checkpointing (unlike last_block_bytes, which is the block's input under checkpointing).
    at = acts.at(candidate.precision)
    return int(at.block_bytes[-1] * at.scale(candidate)) if at.block_bytes else 0


def fsdp2_head_gradient(profile: ModelProfile, candidate: Candidate) -> int:
    """Bytes of the head's unsharded gradient that FSDP2 holds in the root unit from the head's
    backward until the root's post-backward, after every block's (0 for FSDP1, without block
    units, or when the head is frozen). ``candidate`` as run (:func:`as_run`)."""
    if candidate.engine is not Engine.FSDP2 or candidate.one_unit:
        return 0
    _, cb = element_bytes(candidate.precision)
    _, trained_root, _ = gradient_params(profile, candidate)
    return min(head_params(profile), trained_root) * cb


def head_params(profile: ModelProfile) -> int:
    """Parameters of the output head (vocabulary x hidden), whose gradient is made first in
    backward and waits in the root unit until the root's backward ends; 0 without one."""
    if profile.vocab_size and profile.hidden_size and profile.root_unit_params:
        return min(profile.vocab_size * profile.hidden_size, profile.root_unit_params)
    return 0


@dataclass(frozen=True)
class StepBytes:
    """What every moment of one training step of ``candidate`` (as run) is made of."""

    candidate: Candidate
    profile: ModelProfile
    hardware: Hardware
    workload: WorkloadSpec
    acts: ActivationProfile  # at the candidate's precision
    stored_dtype_bytes: int
    compute_dtype_bytes: int
    reduce_dtype_bytes: int
    params: int
    shard: int  # ranks a parameter is sharded over
    wrapped: bool  # block units (a wrap policy); else the whole model is one root unit
    mixed: bool
    block_params: int  # the largest block unit's (0 without block units)
    root_params: int  # the root unit's (the whole model without block units)
    trained_params: int
    trained_root_params: int
    trained_block_params: int
    head_params: int  # the output head's (vocabulary x hidden; 0 without one)
    param_shard_bytes: int  # this rank's shard of every parameter (0 offloaded)
    grad_shard_bytes: int  # ... of every gradient
    optimizer_bytes: int  # ... of the optimizer states
    gathered_bytes: int  # unsharded parameters through forward and backward
    kept_after_forward_bytes: int  # unsharded parameters at the loss
    # the root and the last block gathered as backward starts (a loss computed in forward, the
    # head's backward): FSDP1 prefetches the block whole, FSDP2 holds what it kept after forward
    backward_start_unsharded_bytes: int
    gather_buffer_bytes: int  # the next unit's all-gather output (FSDP2)
    comm_bytes: int  # one unit's reduce-scatter input and the next unit's all-gather buffer
    saved_bytes: int  # activations saved by the whole forward, the loss's included
    loss_saved_bytes: int  # the loss's log-probabilities
    acts_scale: float  # the activation profile's scale to the candidate's micro-batch
    block_backward_bytes: int  # the one unit's backward temporaries (or any block's)
    recomputed_backward_bytes: int  # a checkpointed block's backward temporaries
    recomputed_grads_bytes: int  # of those, its parameters' gradients at the peak
    plain_backward_bytes: int  # a block's that is not checkpointed
    logits_grad_bytes: int  # the logits' gradient in fp32
    foreach_bytes: int  # the foreach optimizer's transient copy of one state
    block_grad_shard_bytes: int  # the blocks' gradients, reduced to shards
    frozen_root_bytes: int  # a root that does not train, gathered for good (FSDP1)
    head_grad_bytes: int  # the head's unsharded gradient waiting in the root (FSDP2)
    kept_grad_bytes: int  # unsharded gradients kept between micro-batches when the sync is skipped
    host_bytes: int  # per node, offloaded
    root_copy_bytes: int  # offloaded: the root's copy of its host shard, through its backward
    # offloaded, a copy of each unit kept, one shard: the unit copies beside the top block's
    # backward, its own forward copy (not checkpointed) and the next block's, prefetched
    block_copies_bytes: int

    @property
    def gathers(self) -> bool:
        """Whether units are gathered into unsharded copies (sharded, or cast under mixed
        precision; fp32 NO_SHARD computes on the parameters themselves)."""
        return self.shard > 1 or self.mixed

    @property
    def engine(self) -> Engine:
        return self.candidate.engine

    @property
    def reshards_blocks(self) -> bool:
        """Whether block units are freed after forward and gathered again in backward (each
        block's backward is then its own event; else every unit is held and the top is the
        worst)."""
        return self.wrapped and traits(self.candidate).reshards

    def block_backward(self, index: int) -> int:
        """Block ``index``'s backward temporaries, by whether it is checkpointed (``index``
        counts from the end when negative; the one unit's without blocks). A checkpointed
        block's include its parameters' gradients made by its peak, but FSDP2's top block's:
        its events count them as the unit's reduce buffer (the blocks below hold the reduce
        buffer of the block above instead: 7B shape at 64 and 512 ranks, simulated)."""
        blocks = self.profile.block_count
        if not self.wrapped or not blocks or not -blocks <= index < blocks:
            return self.block_backward_bytes
        if not self.candidate.checkpoints(index % blocks):
            return self.plain_backward_bytes
        top = index % blocks == blocks - 1
        counted = self.recomputed_grads_bytes if top and self.engine is Engine.FSDP2 else 0
        return self.recomputed_backward_bytes - counted


def _gathered_bytes(
    candidate: Candidate, acts: ActivationProfile, *, params: int, root: int, unit: int
) -> tuple[int, int]:
    """(unsharded parameter bytes through the step, those kept at the loss) by the sharding."""
    cb = element_bytes(candidate.precision)[1]
    wrapped = not candidate.one_unit
    if traits(candidate).keeps_gathered:
        return params * cb, params * cb  # kept gathered from forward to backward
    if not traits(candidate).shards_params and candidate.engine is Engine.FSDP2:
        # FSDP2 replicates on a (world, 1) mesh and still gathers copies, in every precision:
        # the root and the current unit (measured on fake tensors; nothing is prefetched)
        return ((unit + root) * cb if wrapped else params * cb), 0
    mixed = candidate.precision.mixed
    if not traits(candidate).shards_params:
        # low-precision copies of the current unit and the prefetched one (or of the one unit)
        unsharded = ((2 * unit if wrapped else params) * cb) if mixed else 0
        # A loss computed in the root's forward (a Hugging Face model given labels) runs
        # beside FSDP1's low-precision copy of the root, freed when the root's forward ends
        # (a loss outside the model runs without; provenance: benchmarks/results/memory_moments.md)
        in_root = mixed and candidate.engine is Engine.FSDP1 and acts.loss_in_forward
        return unsharded, root * cb if in_root else 0
    # the current and the prefetched unit, and the root; at the loss, what the engine keeps
    kept = policy_of(candidate).keeps_after_forward(candidate, root, unit)
    return (2 * unit + root) * cb, kept * cb


def _gather_buffer_bytes(candidate: Candidate, shard: int, params: int, unit: int) -> int:
    """The next unit's all-gather output, resharding after forward: FSDP2 gathers into a
    buffer and copies each unit out of it; FSDP1 gathers straight into the unit's padded flat
    parameter (counted as unsharded)."""
    if shard == 1 or candidate.engine is not Engine.FSDP2:
        return 0
    cb = element_bytes(candidate.precision)[1]
    if candidate.one_unit:
        return params * cb  # the one unit, copied out of its all-gather buffer
    return 0 if traits(candidate).keeps_gathered else unit * cb


def _block_backward_bytes(
    candidate: Candidate, acts: ActivationProfile, recompute: int, *, recomputes: bool
) -> tuple[int, int]:
    """(one block's backward temporaries, of those its parameters' gradients) (``recomputes``:
    it is checkpointed). It turns its saved activations into gradients as it goes: the moment
    holds the larger of the two, not both. A checkpointed block's is measured on fake tensors
    (its recompute, the gradient from above, the activations' gradients as they are made and
    its parameters' gradients made by then: :mod:`autoshard.predict.backward_peak`); where it
    was not measured, the recompute and half the block's fp32 activations (fitted at 64-128
    tokens), parameters' gradients not told apart."""
    # Activation gradients are made in the compute dtype, also where the forward saved an fp32
    # upcast: sized from the fp32 profile when there is one (with fused attention).
    uniform = acts.fused_at(Precision.FP32)
    block_grad = int(max(uniform.block_bytes, default=0) * uniform.scale(candidate))
    if not recomputes:
        at = acts.at(candidate.precision)
        return max(0, block_grad - int(max(at.block_bytes, default=0) * at.scale(candidate))), 0
    at = acts.at(candidate.precision)
    selective = candidate.checkpointing is Checkpointing.SELECTIVE
    total, activations_only = at.selective_backward if selective else at.checkpointed_backward
    if total:
        # activations grow with the micro-batch, the parameters' gradients do not
        scale = at.scale(candidate)
        grads = int((total - activations_only) * scale / candidate.micro_batch_size)
        return int(activations_only * scale) + grads, grads
    return recompute + block_grad // 2, 0


class Offloaded(NamedTuple):
    """What an offloading candidate holds on the device instead of its resident state, and
    on the host (:func:`offloaded`)."""

    device_copies: int  # copies of the host shards held through the step (sharded_params)
    unsharded: int  # unsharded parameters through forward and backward (gathered_bytes)
    block_grads: int  # the blocks' reduced gradients, on the device until the backward ends
    root_copy: int  # the root's copy of its host shard through its backward
    block_copies: int  # one shard: the unit copies beside the top block's backward
    host: int  # per node


def offloaded(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    resident: tuple[int, int, int],
    unsharded: int,
    block_grads: int,
) -> Offloaded:
    """Under CPU offload, from the engine's rules (the policy's ``offload_*``) and what is
    ``resident`` without offload (this rank's parameters, gradients and optimizer states).
    Checked against FSDP1's offload run on CPU processes
    (:mod:`autoshard.predict.offload_emulation`): FSDP1 without parameter mixed precision keeps
    a copy of every unit's shard (NO_SHARD, SHARD_GRAD_OP) or of the root's and the computing
    unit's (FULL_SHARD); at one shard a unit's backward runs beside the copy its forward made
    (what its backward saved points into it, where the unit is not checkpointed), the root's
    through the head's backward, and the next unit's is prefetched beside its forward copy.
    Its gradients stay on the device until the backward ends: none at the optimizer step or
    in the next forward."""
    policy = policy_of(candidate)
    stored, _ = element_bytes(candidate.precision)
    shard = shard_size(candidate, hardware)
    params, grads, optimizer = resident
    pinned = policy.host_pinned_bytes(profile, candidate, shard)
    host = (pinned + optimizer if pinned else params + grads + optimizer) * hardware.gpus_per_node
    wrapped = not candidate.one_unit and profile.block_count > 0
    root = profile.root_unit_params if wrapped else profile.total_params
    unit = profile.block_params if wrapped else 0
    device = root_copy = block_copies = 0
    match policy.offload_device_copies(candidate):
        case OffloadCopies.ALL if shard == 1:
            device = params
            unsharded = (root + unit) * stored  # the root's and the last block's next copies
            top_saves = wrapped and not candidate.checkpoints(profile.block_count - 1)
            block_copies = (1 + top_saves) * unit * stored
        case OffloadCopies.ALL:
            device = params
        case OffloadCopies.COMPUTING:  # none left at the loss: the root's forward is done
            root_copy = root * stored // shard
            unsharded += root_copy + unit * stored // shard
    kept = block_grads if policy.offload_keeps_gradients(candidate) else 0
    return Offloaded(device, unsharded, kept, root_copy, block_copies, host)


def step_bytes(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    acts: ActivationProfile,
) -> StepBytes:
    """What the moments share, for ``candidate`` as the engine runs it (nothing of the
    parameters, gradients and optimizer states on the GPU when offloaded; ``host_bytes``)."""
    candidate = as_run(candidate, hardware)
    stored, cb = element_bytes(candidate.precision)
    params = profile.total_params
    shard = shard_size(candidate, hardware)
    wrapped = not candidate.one_unit
    unit = max(profile.block_params, 1) if wrapped else 0
    root = profile.root_unit_params if wrapped else params
    # Frozen parameters carry no gradient and no optimizer state (gradient_params).
    trained, trained_root, trained_unit = gradient_params(profile, candidate)
    sharded = params * stored // shard
    grads = trained * stored // shard
    # of one rank: its states, and the foreach step's transient copies of its shard
    optimizer, one_state = optimizer_bytes(profile, candidate, shard)
    unsharded, after_forward = _gathered_bytes(candidate, acts, params=params, root=root, unit=unit)
    fsdp1 = candidate.engine is Engine.FSDP1
    last = unit if fsdp1 else policy_of(candidate).keeps_after_forward(candidate, 0, unit)
    reduce = reduce_bytes(candidate)
    gather = _gather_buffer_bytes(candidate, shard, params, unit)
    saved, recompute = activation_bytes(candidate, acts)
    at = acts.at(candidate.precision)
    logits = 0
    if profile.vocab_size and workload.seq_len:  # the logits' gradient in fp32 (cross-entropy)
        logits = candidate.micro_batch_size * workload.seq_len * profile.vocab_size * 4
    block_grads = (trained - trained_root) * stored // shard
    # FSDP1 never reshards a root unit that does not train (no gradient, so no post-backward
    # hook): once gathered by the first forward it stays gathered (measured on fake tensors).
    frozen_root = candidate.engine is Engine.FSDP1 and wrapped and shard > 1 and not trained_root

    def backward(recomputes: bool) -> int:
        return _block_backward_bytes(candidate, acts, recompute, recomputes=recomputes)[0]

    # FSDP2 counts the one unit's (or the top block's) parameters' gradients as its reduce buffer
    recomputed_grads = _block_backward_bytes(candidate, acts, recompute, recomputes=True)[1]
    fsdp2_grads = recomputed_grads if candidate.engine is Engine.FSDP2 else 0

    held = Offloaded(0, unsharded, block_grads, 0, 0, 0)
    if candidate.cpu_offload:
        held = offloaded(
            profile, candidate, hardware, (sharded, grads, optimizer), unsharded, block_grads
        )
        sharded, unsharded, block_grads = held.device_copies, held.unsharded, held.block_grads
        grads = optimizer = one_state = 0
    return StepBytes(
        candidate=candidate, profile=profile, hardware=hardware, workload=workload, acts=at,
        stored_dtype_bytes=stored, compute_dtype_bytes=cb, reduce_dtype_bytes=reduce,
        params=params, shard=shard,
        wrapped=wrapped, mixed=candidate.precision.mixed, block_params=unit, root_params=root,
        trained_params=trained, trained_root_params=trained_root,
        trained_block_params=trained_unit, head_params=head_params(profile),
        param_shard_bytes=sharded, grad_shard_bytes=grads, optimizer_bytes=optimizer,
        gathered_bytes=unsharded, kept_after_forward_bytes=after_forward,
        backward_start_unsharded_bytes=(root + last) * cb,
        gather_buffer_bytes=gather, comm_bytes=trained_unit * reduce + gather,
        saved_bytes=saved, loss_saved_bytes=candidate.micro_batch_size * at.loss_bytes,
        acts_scale=at.scale(candidate),
        block_backward_bytes=backward(candidate.checkpointing is not Checkpointing.NONE)
        - (fsdp2_grads if candidate.checkpointing is not Checkpointing.NONE else 0),
        recomputed_backward_bytes=backward(True), recomputed_grads_bytes=recomputed_grads,
        plain_backward_bytes=backward(False),
        logits_grad_bytes=logits, foreach_bytes=one_state,
        block_grad_shard_bytes=block_grads, frozen_root_bytes=root * cb if frozen_root else 0,
        head_grad_bytes=fsdp2_head_gradient(profile, candidate),
        kept_grad_bytes=policy_of(candidate).accumulated_gradient_bytes(profile, candidate),
        host_bytes=held.host, root_copy_bytes=held.root_copy,
        block_copies_bytes=held.block_copies,
    )  # fmt: skip
