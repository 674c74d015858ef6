"""Analytic per-rank memory of an FSDP candidate: pure arithmetic after one activation profile
(:mod:`autoshard.predict.activations`).

The per-rank peak is the largest of the moments of a training step, each a sum of terms (see
``../shared/design.md``, "Memory", and :func:`peak_moments`): the loss at the end of forward,
the head's backward, the top and bottom blocks' backward, the root's backward, the optimizer
step, and with gloo each reduce-scatter. The terms:
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

from autoshard.config import (
    Candidate,
    Checkpointing,
    Engine,
    Hardware,
    Optimizer,
    OptimizerImpl,
    Precision,
    Sharding,
    WorkloadSpec,
)
from autoshard.predict.activations import ActivationProfile, precision_bytes, rule_of_thumb
from autoshard.results import MemoryBreakdown, MemoryEstimate, ModelProfile
from autoshard.sharding import reshard_after_forward

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


def as_run(candidate: Candidate, hardware: Hardware) -> Candidate:
    """The configuration the engine runs: FSDP1 on a world of one rank switches every sharding
    strategy to NO_SHARD (``FullyShardedDataParallel`` warns and does so; parameters then stay
    whole, no unsharded copies are gathered), while FSDP2 shards over the one rank as asked."""
    if (
        candidate.engine is Engine.FSDP1
        and hardware.world_size == 1
        and candidate.sharding is not Sharding.NO_SHARD
    ):
        return candidate.model_copy(update={"sharding": Sharding.NO_SHARD, "hybrid_mesh": None})
    return candidate


def shard_size(candidate: Candidate, hardware: Hardware) -> int:
    match candidate.sharding:
        case Sharding.NO_SHARD:
            return 1
        case Sharding.HYBRID_SHARD:
            assert candidate.hybrid_mesh is not None
            return candidate.hybrid_mesh[1]
        case Sharding.FULL_SHARD | Sharding.SHARD_GRAD_OP:
            return hardware.world_size
        case _:
            raise ValueError(f"unknown sharding {candidate.sharding!r}")


def activation_bytes(candidate: Candidate, acts: ActivationProfile) -> tuple[int, int]:
    """(saved activations, recompute transient) for the candidate's micro-batch, in bytes."""
    acts = acts.at(candidate.precision)
    scale = acts.scale(candidate)
    blocks, inputs = acts.block_bytes, acts.block_input_bytes
    largest = max(blocks, default=0)
    match candidate.checkpointing:
        case Checkpointing.NONE:
            saved = sum(blocks)
            recompute = 0
        case Checkpointing.ALL | Checkpointing.EVERY_K:
            every = (
                candidate.checkpoint_every
                if candidate.checkpointing is Checkpointing.EVERY_K
                else 1
            )
            saved = sum(
                (inputs[i] if i < len(inputs) else 0) if i % every == 0 else b
                for i, b in enumerate(blocks)
            )
            recompute = largest  # one block's activations are rebuilt at a time in backward
        case _:
            raise ValueError(f"unknown checkpointing {candidate.checkpointing!r}")
    loss = candidate.micro_batch_size * acts.loss_bytes
    return int((saved + acts.other_bytes) * scale) + loss, int(recompute * scale)


def resharded_sharding(candidate: Candidate) -> bool:
    """Whether the candidate's units are freed after forward and gathered again in backward."""
    return candidate.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)


def kept_after_forward(candidate: Candidate, root: int, unit: int) -> int:
    """Parameters an FSDP2 candidate keeps gathered from forward into backward, by its reshard
    policy (:func:`autoshard.sharding.reshard_after_forward`): the root unit and, with
    KEEP_ROOT_AND_LAST, the last block (``unit`` parameters; 0 without block units)."""
    kept = 0 if reshard_after_forward(candidate, root=True) else root
    return kept + (0 if reshard_after_forward(candidate, last=True) else unit)


def last_block_bytes(candidate: Candidate, acts: ActivationProfile) -> int:
    """What the last block saved in forward (its input under checkpointing): freed when its
    backward is done."""
    acts = acts.at(candidate.precision)
    if not acts.block_bytes:
        return 0
    ckpt = candidate.checkpointing is not Checkpointing.NONE
    last = acts.block_input_bytes[-1] if ckpt and acts.block_input_bytes else acts.block_bytes[-1]
    return int(last * acts.scale(candidate))


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
    >>> workload = WorkloadSpec(seq_len=128)
    >>> moments, host = peak_moments(
    ...     profile, Candidate(wrap_classes=profile.wrap_policy),
    ...     Hardware(gpus_per_node=8, gpu_memory=80 * 2**30), workload,
    ...     profile_activations(built.model, profile, workload))
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
    >>> host  # nothing offloaded
    0
    """
    candidate = as_run(candidate, hardware)
    stored, cb = precision_bytes(candidate.precision)
    params = profile.total_params
    shard = shard_size(candidate, hardware)
    # Without a wrap policy the whole model is one (root) unit: no block units to prefetch.
    wrapped = not candidate.one_unit
    unit = max(profile.block_params, 1) if wrapped else 0
    root = profile.root_unit_params if wrapped else params
    mixed = candidate.precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    sharded = params * stored // shard
    grads = params * stored // shard
    states = {Optimizer.ADAMW: 2, Optimizer.ADAM: 2, Optimizer.SGD: 1}[candidate.optimizer]
    optimizer = states * params * stored // shard

    if candidate.sharding is Sharding.SHARD_GRAD_OP:
        unsharded = params * cb  # kept gathered from forward to backward
        after_forward = unsharded
    elif candidate.sharding is Sharding.NO_SHARD:
        # low-precision copies of the current unit and the prefetched one (or of the one unit)
        unsharded = ((2 * unit if wrapped else params) * cb) if mixed else 0
        after_forward = 0
    else:
        unsharded = (2 * unit + root) * cb  # current + prefetched unit, and the root
        # When the loss is computed, FSDP1 keeps the root gathered from forward into backward;
        # FSDP2 keeps what its reshard policy keeps (the root, the last block), nothing with ALL.
        after_forward = (
            root * cb
            if candidate.engine is Engine.FSDP1
            else kept_after_forward(candidate, root, unit) * cb
        )
    # Lightning's FSDP1 reduces in the compute dtype; FSDP2 here reduces in fp32 when mixed.
    fp32_reduce = mixed and candidate.engine is Engine.FSDP2 and candidate.reduce_dtype_fp32
    reduce_bytes = 4 if fp32_reduce else cb
    # the reduce-scatter input of one unit, and (resharding after forward) the next unit's
    # all-gather output: FSDP2 gathers into a buffer and copies each unit out of it; FSDP1
    # gathers straight into the unit's padded flat parameter (counted as unsharded).
    gather = 0
    if shard > 1 and candidate.engine is Engine.FSDP2:
        if not wrapped:
            gather = params * cb  # the one unit, copied out of its all-gather buffer
        elif candidate.sharding is not Sharding.SHARD_GRAD_OP:
            gather = unit * cb
    comm = unit * reduce_bytes + gather

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
        params * stored // shard
        if candidate.optimizer_impl is OptimizerImpl.FOREACH
        and candidate.optimizer is not Optimizer.SGD
        else 0
    )

    block_grads = (params - root) * stored // shard  # the blocks' gradients, reduced to shards
    host = 0
    if candidate.cpu_offload:
        # parameters, gradients and optimizer state live in host memory; the GPU keeps the
        # working set only
        host = (sharded + grads + optimizer) * hardware.gpus_per_node
        sharded = grads = optimizer = foreach = block_grads = 0

    # Several moments compete for the peak (measured with torch's tracker, design notes "Memory");
    # gradients are set to None after each step, so backward starts without any.
    # 0. The loss, at the end of forward: every activation saved; the logits, their shifted
    #    copy (or fp32 cast) and the log-probabilities alive together.
    #    A model that computes its loss in forward (a Hugging Face model given labels) has the
    #    root's backward hooks on the loss itself: the root is gathered and the last block
    #    prefetched before the loss's backward, beside its temporaries (simulated).
    early = acts.loss_in_forward and wrapped and resharded_sharding(candidate)
    loss_moment = MemoryBreakdown(
        sharded_params=sharded,
        unsharded_params=(
            (
                root
                + (
                    unit
                    if candidate.engine is Engine.FSDP1
                    else kept_after_forward(candidate, 0, unit)
                )
            )
            * cb
            if early
            else after_forward
        ),
        optimizer=optimizer,
        comm_buffers=gather if early else 0,
        activations=saved,
        temporaries=2 * logits,
        buffers=profile.buffer_bytes,
    )
    # 1. The head's backward: the loss's backward is done (its log-probabilities freed), the
    #    logits' gradient alive, the root gathered again with the working set.
    #    FSDP2 gathers the last block into its all-gather buffer meanwhile (prefetched), and
    #    copies it out only when the block's backward starts (simulated, torch 2.13).
    fsdp2_resharded = (
        candidate.engine is Engine.FSDP2
        and wrapped
        and candidate.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
    )
    head = MemoryBreakdown(
        sharded_params=sharded,
        unsharded_params=(
            (root + kept_after_forward(candidate, 0, unit)) * cb if fsdp2_resharded else unsharded
        ),
        optimizer=optimizer,
        comm_buffers=comm - unit * reduce_bytes,  # no block has reduced its gradients yet
        activations=saved - loss_saved,
        temporaries=logits,
        buffers=profile.buffer_bytes,
    )
    # 2. The top block's backward: the block recomputes under checkpointing and makes its
    #    gradients.
    resharded = wrapped and candidate.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
    if not wrapped:  # the one unit stays gathered through backward
        top_block = head.model_copy(update={"temporaries": block_backward})
    elif resharded:
        # The block being computed, the next one gathering into its all-gather buffer, and the
        # root, gathered from the head's backward until its own at the very end (torch 2.13,
        # simulated: FSDP2 holds the root and one block unsharded during the blocks' backward).
        top_block = head.model_copy(
            update={
                "unsharded_params": (unit + root) * cb,
                "temporaries": block_backward,
            }
        )
    elif candidate.sharding is Sharding.SHARD_GRAD_OP:
        # the top block's parameters are freed once its gradients are reduced
        top_block = head.model_copy(
            update={
                "unsharded_params": unsharded - unit * cb,
                "temporaries": block_backward,
            }
        )
    else:  # NO_SHARD: nothing is gathered or freed
        top_block = head.model_copy(update={"temporaries": block_backward})
    top_block = top_block.model_copy(update={"comm_buffers": comm})  # it reduces its gradients
    # 3. The bottom block's backward: the other blocks' activations are freed and their
    #    gradients reduced into shards; the root (the embedding) is prefetched in place of a
    #    next block. (SHARD_GRAD_OP holds everything all along: the top block is worse.)
    blocks = max(profile.block_count, 1)
    bottom_block = top_block.model_copy(
        update={
            "unsharded_params": (unit + root) * cb,
            # every block's gradient in shards but its own
            "gradients": block_grads * (blocks - 1) // blocks,
            "activations": first_block_bytes(candidate, acts),
            # the block above's reduce-scatter; nothing left to prefetch (the root is gathered)
            "comm_buffers": comm - gather if wrapped else comm,
        }
    )
    if candidate.engine is Engine.FSDP1 and resharded:
        # FSDP1 keeps the root gathered until the root's own backward at the very end, and a
        # unit's flat gradient only appears when the unit's backward is done (the parameters'
        # gradients flow through views of the flat parameter), after its temporaries are freed
        # (the block gradient moments). The worst block but the top is the second: its own
        # unit, the first prefetched (simulated, torch 2.13).
        top_block = top_block.model_copy(update={"unsharded_params": unsharded, "comm_buffers": 0})
        bottom_block = bottom_block.model_copy(
            update={
                "unsharded_params": unsharded,
                "comm_buffers": 0,
                "gradients": block_grads * max(blocks - 2, 0) // blocks,
            }
        )
    # 4. The root's backward, at the very end: the embedding's gradient completes the root's
    #    unsharded gradient, which is reduced (cast to the reduce dtype) into its shard; every
    #    block's gradient is already sharded. FSDP1 still holds the root gathered; FSDP2 has
    #    resharded it. Both copy the gradient into a reduce-scatter input beside it (simulated:
    #    FSDP2 too, even when no cast is needed); NO_SHARD all-reduces in place unless it casts.
    gathered_root = candidate.engine is Engine.FSDP1 and candidate.sharding is not Sharding.NO_SHARD
    root_backward = MemoryBreakdown(
        sharded_params=sharded,
        unsharded_params=root * cb if gathered_root or (mixed and shard == 1) else 0,
        gradients=block_grads + root * cb,
        optimizer=optimizer,
        comm_buffers=root * reduce_bytes if shard > 1 or reduce_bytes != cb else 0,
        activations=int(acts.other_bytes * scale),
        buffers=profile.buffer_bytes,
    )
    # 5. The optimizer step: gradients and the foreach transient, no activations.
    step = MemoryBreakdown(
        sharded_params=sharded,
        gradients=grads,
        optimizer=optimizer,
        temporaries=foreach,
        buffers=profile.buffer_bytes,
    )
    reduce_scatters = {}
    # gloo reduce-scatters a copy of its input (ProcessGroupGloo: +1x the input, measured around
    # a bare collective; NCCL works in place, all-reduce copies nothing).
    gloo_copy = hardware.backend == "gloo" and shard > 1
    if candidate.engine is Engine.FSDP1 and wrapped and shard > 1:
        # A unit's backward ends with its parameters' gradients concatenated into the flat
        # gradient (both alive), the unit still gathered (it is resharded next, then reduced):
        # the top block's activations are freed by then, the others' still saved; the bottom
        # block's are the last, with every other block's gradient in shards.
        gradient = {"temporaries": 0, "comm_buffers": 2 * unit * reduce_bytes}
        reduce_scatters["top block gradient"] = top_block.model_copy(
            update={
                **gradient,
                "unsharded_params": unsharded if resharded else params * cb,
                "activations": saved - loss_saved - last_block_bytes(candidate, acts),
            }
        )
        if resharded:
            reduce_scatters["bottom block gradient"] = bottom_block.model_copy(
                update={**gradient, "unsharded_params": (unit + root) * cb}
            )
    if gloo_copy:
        # Each copy lives while its unit's gradients are reduced: after the unit's backward
        # temporaries are freed (simulated with the copy).
        if wrapped:
            last = bottom_block if resharded else top_block
            reduce_scatters["block reduce-scatter"] = last.model_copy(
                update={"temporaries": 0, "comm_buffers": last.comm_buffers + unit * reduce_bytes}
            )
        reduce_scatters["root reduce-scatter"] = root_backward.model_copy(
            update={
                "unsharded_params": root_backward.unsharded_params
                - (root * cb if gathered_root else 0),
                "comm_buffers": root_backward.comm_buffers + root * reduce_bytes,
            }
        )
    moments = {
        "loss": loss_moment,
        "head backward": head,
        "top block backward": top_block,
        **({"bottom block backward": bottom_block} if resharded else {}),
        "root backward": root_backward,
        "optimizer step": step,
        **reduce_scatters,
    }
    return moments, host


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
