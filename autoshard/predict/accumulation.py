"""The rules of gradient accumulation's own events, by the turn of the step's timeline they
happen in: :mod:`autoshard.predict.step_memory` walks the later micro-batches' turns and calls
them where the engine holds something else than the first micro-batch's event; the walk adds
the gradients carried in from the earlier micro-batches to every event (its state), so the rules
count only what the micro-batch itself adds.

- the sync skipped (FSDP1 ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``): every
  micro-batch after the first runs beside the unsharded gradients of all the units that train
  (:attr:`StepBytes.kept_grad_bytes`), adding each unit's fresh ones in; the last reduces them
  (``synchronising``);
- the sync kept (Lightning's Trainer with FSDP2): every micro-batch reduces into the sharded
  gradients (:func:`unreduced`); FSDP2's own events here.

Measured on fake tensors unless a rule says otherwise.
"""

from __future__ import annotations

from autoshard.config import Candidate, Engine, Hardware
from autoshard.engine import as_run, policy_of, traits
from autoshard.predict.step_bytes import StepBytes, last_block_all_activations
from autoshard.results import MemoryBreakdown, ModelProfile


def accumulated_gradient_bytes(
    profile: ModelProfile, candidate: Candidate, hardware: Hardware
) -> int:
    """Bytes of the unsharded gradients kept between micro-batches when the sync is skipped:
    FSDP1 keeps each unit's whole flat gradient in the compute dtype; FSDP2 keeps each
    parameter's in the reduce dtype (fp32 under mixed precision with an fp32 reduce)."""
    candidate = as_run(candidate, hardware)
    return policy_of(candidate).accumulated_gradient_bytes(profile, candidate)


# -- the sync skipped: a later micro-batch (not the last) -------------------------------------


def _upcasts(t: StepBytes) -> bool:
    """FSDP2 under mixed precision with an fp32 reduce upcasts a unit's fresh gradients before
    adding them into the kept ones."""
    return t.engine is Engine.FSDP2 and t.mixed and t.candidate.reduce_dtype_fp32


def _fresh(t: StepBytes, params: int) -> int:
    """A unit's new gradients before they join the kept ones: FSDP1 also concatenates them into
    a flat one (twice the unit); FSDP2 upcasts them to fp32 first, or without an upcast autograd
    adds into the kept gradient in place."""
    cb = t.compute_dtype_bytes
    if t.engine is Engine.FSDP1:
        return 2 * params * cb
    return params * cb + params * 4 if _upcasts(t) else 0


def kept_head(t: StepBytes, head: MemoryBreakdown) -> MemoryBreakdown:
    """The plain ``head`` backward event's working set in a later micro-batch: FSDP1 keeps
    the root gathered until the root's backward ends, FSDP2 re-gathers it at backward's start
    (also with NO_SHARD)."""
    fsdp2_root = t.root_params * t.compute_dtype_bytes if t.engine is Engine.FSDP2 else 0
    return head.model_copy(update={"unsharded_params": max(head.unsharded_params, fsdp2_root)})


def kept_head_backward(t: StepBytes, head: MemoryBreakdown) -> MemoryBreakdown:
    """The head's backward in a later micro-batch (from :func:`kept_head`'s working set): its
    weight's fresh gradient (one tensor) beside the logits' gradient, before it joins the kept
    one."""
    fresh = t.head_params * t.compute_dtype_bytes if t.trained_root_params else 0
    return head.model_copy(update={"temporaries": head.temporaries + fresh})


def _kept_base(t: StepBytes, head: MemoryBreakdown) -> MemoryBreakdown:
    """The plain ``head`` event without gradients, buffers or temporaries."""
    update = {"comm_buffers": 0, "temporaries": 0, "gradients": 0}
    return head.model_copy(update=update)


def _kept_gathered(t: StepBytes) -> int:
    """The units gathered through a later micro-batch's backward: FSDP1 the root, the block and
    the prefetched one; FSDP2 the root and the block (its prefetch is a buffer); every unit
    where nothing is freed between micro-batches (SHARD_GRAD_OP)."""
    if traits(t.candidate).keeps_gathered:
        return t.params * t.compute_dtype_bytes
    if not t.gathers:
        return 0
    unit = 0 if t.candidate.one_unit else t.profile.block_params
    units = 2 if t.engine is Engine.FSDP1 else 1
    return (t.root_params + units * unit) * t.compute_dtype_bytes


def kept_block_backward(t: StepBytes, head: MemoryBreakdown) -> MemoryBreakdown | None:
    """A block's backward beside the kept gradients (the plain ``head`` event's working set):
    its unit's fresh gradients beside the kept ones until they are added in, and the head's
    gradient, which waits in the root unit for its flat gradient (FSDP1) or its upcast (FSDP2
    mixed; without an upcast FSDP2 adds it into the kept gradient at once). No reduce-scatter
    runs in these micro-batches. None with one unit."""
    if t.candidate.one_unit:
        return None
    waits = t.engine is Engine.FSDP1 or _upcasts(t)
    cb = t.compute_dtype_bytes
    head_grad = t.head_params * cb if t.trained_root_params and waits else 0
    buffers = 0
    if t.engine is Engine.FSDP2 and t.shard > 1:
        buffers = t.profile.block_params * cb
    last = last_block_all_activations(t.candidate, t.acts)
    return _kept_base(t, head).model_copy(
        update={
            "unsharded_params": _kept_gathered(t),
            "comm_buffers": buffers,
            "activations": head.activations - last,
            "temporaries": head_grad + _fresh(t, t.trained_block_params),
        }
    )


def kept_root_backward(t: StepBytes, head: MemoryBreakdown) -> MemoryBreakdown:
    """The root's backward beside the kept gradients, its fresh gradients added in."""
    keeps_all = traits(t.candidate).keeps_gathered
    root = t.root_params * t.compute_dtype_bytes if t.gathers else 0
    return _kept_base(t, head).model_copy(
        update={
            "unsharded_params": _kept_gathered(t) if keeps_all else root,
            "activations": int(t.acts.other_bytes * t.acts_scale),
            "temporaries": _fresh(t, t.trained_root_params),
        }
    )


# -- the sync skipped: the last micro-batch, which reduces --------------------------------------


def synchronising_top_block(
    t: StepBytes, top: MemoryBreakdown, second: MemoryBreakdown | None
) -> MemoryBreakdown:
    """The last micro-batch after skipped syncs: the top block reduces its gradients while every
    other unit's kept gradients are still unsharded (from the plain ``top`` block's event; FSDP2
    holds the block above's reduce-scatter input, as the plain ``second`` block does)."""
    if second is not None:
        top = top.model_copy(update={"comm_buffers": second.comm_buffers})
    # FSDP1 reduce-scatters the unit's flat gradient itself, one of the kept ones
    own = t.trained_block_params * t.reduce_dtype_bytes if t.engine is Engine.FSDP1 else 0
    # the head's gradient is one of the kept ones
    gradients = top.gradients - t.head_grad_bytes
    return top.model_copy(
        update={"gradients": gradients, "comm_buffers": max(0, top.comm_buffers - own)}
    )


def synchronising_reduce_scatter(t: StepBytes, sync: MemoryBreakdown) -> MemoryBreakdown | None:
    """gloo's copy of the reduce input (a bare collective's +1x) beside the synchronising top
    block's event ``sync``."""
    if not (t.hardware.backend == "gloo" and t.shard > 1):
        return None
    reducing = t.trained_block_params * t.reduce_dtype_bytes
    return sync.model_copy(update={"temporaries": 0, "comm_buffers": sync.comm_buffers + reducing})


def fsdp1_synchronising_blocks(t: StepBytes, sync: MemoryBreakdown) -> MemoryBreakdown | None:
    """FSDP1's last micro-batch after ``no_sync``, resharding: each block, once its backward is
    done, reduces its kept (unsharded, compute-dtype) flat gradient into its stored gradient
    (NO_SHARD: cast to the parameters' dtype, the whole unit) while the blocks below still keep
    theirs. The worst block, from the synchronising top block's event ``sync``, is where the
    stored gradients above outgrow the activations freed (provenance:
    benchmarks/results/memory_moments.md). None where it is not an event."""
    if t.engine is not Engine.FSDP1 or t.candidate.one_unit:
        return None
    if traits(t.candidate).keeps_gathered:
        return None
    cb = t.compute_dtype_bytes
    root, unit = t.profile.root_unit_params, t.profile.block_params
    blocks = max(t.profile.block_count, 1)
    saved = t.acts.block_bytes
    reduced = t.trained_block_params * t.stored_dtype_bytes // t.shard  # one unit's stored
    worst: MemoryBreakdown | None = None
    freed = 0
    for j in range(blocks):
        freed += int(saved[blocks - 1 - j] * t.acts_scale) if j < len(saved) else 0
        # FSDP1 keeps the root gathered; the block and the next one prefetched
        gathered = (root + (2 if j < blocks - 1 else 1) * unit) * cb if t.gathers else 0
        event = sync.model_copy(
            update={
                "unsharded_params": gathered,
                "gradients": j * (reduced - t.trained_block_params * cb),
                "activations": max(0, sync.activations - freed),
                "comm_buffers": 0,
                "temporaries": reduced,  # the block's own, beside its kept one
            }
        )
        if worst is None or event.total > worst.total:
            worst = event
    return worst


# -- the sync kept: FSDP2's own events ----------------------------------------------------------


def fsdp2_reduced_block_backward(t: StepBytes, head: MemoryBreakdown) -> MemoryBreakdown | None:
    """FSDP2, synced accumulation: the second block from the top, its fresh gradients and the
    top block's reduce-scatter input beside the head's gradient waiting in the root (the plain
    ``head`` event's working set). None for FSDP1 or one unit."""
    if t.engine is not Engine.FSDP2 or t.candidate.one_unit:
        return None
    cb = t.compute_dtype_bytes
    block = t.profile.block_params * cb
    head_grad = t.head_params * cb * (t.trained_root_params > 0)
    return head.model_copy(
        update={
            "gradients": t.trained_block_params * t.reduce_dtype_bytes // t.shard,
            "unsharded_params": (t.profile.root_unit_params + t.profile.block_params) * cb,
            "comm_buffers": block if t.shard > 1 else 0,
            "activations": head.activations - 2 * last_block_all_activations(t.candidate, t.acts),
            "temporaries": head_grad + t.trained_block_params * (cb + t.reduce_dtype_bytes),
        }
    )


def fsdp2_reduced_root_backward(t: StepBytes, root: MemoryBreakdown) -> MemoryBreakdown:
    """FSDP2, synced accumulation: the micro-batch's ``root`` backward event (the plain one with
    the reduced gradients) where, over a shard dimension of 1, FSDP2 copies the gradients into a
    reduce-scatter input even though no cast is needed (NO_SHARD replicates on a (world, 1)
    mesh), then all-reduces (the plain event counts that copy only where it casts)."""
    reduce = t.reduce_dtype_bytes
    if t.engine is not Engine.FSDP2 or t.shard > 1 or reduce != t.compute_dtype_bytes:
        return root
    return root.model_copy(
        update={"comm_buffers": root.comm_buffers + t.trained_root_params * reduce}
    )


def fsdp2_reduced_gradients_waiting(
    t: StepBytes, root: MemoryBreakdown, plain_root: MemoryBreakdown, step: MemoryBreakdown
) -> dict[str, MemoryBreakdown]:
    """FSDP2, synced accumulation with a replicate dimension: every unit's reduced gradients
    wait until backward ends before they are added into the sharded ones (a second set of
    gradients builds up through backward), at the root's backward (``root``: the plain
    ``plain_root`` event with the reduced gradients, before :func:`fsdp2_reduced_root_backward`)
    and at the end of backward (from the plain optimizer ``step``'s). Named without the
    micro-batch's prefix."""
    if t.engine is not Engine.FSDP2 or not traits(t.candidate).replicates:
        return {}
    reduce = t.reduce_dtype_bytes
    unit = 0 if t.candidate.one_unit else t.profile.block_params
    waiting = (t.trained_params - t.trained_root_params) * reduce // t.shard
    return {
        "root backward, reduced gradients waiting": root.model_copy(
            update={"gradients": root.gradients + waiting}
        ),
        "backward end": step.model_copy(
            update={
                # FSDP2 gathers copies, also at 1 shard
                "unsharded_params": (t.root_params + unit) * t.compute_dtype_bytes,
                "gradients": t.trained_params * reduce // t.shard,
                "temporaries": 0,
                "activations": plain_root.activations,
            }
        ),
    }


def unreduced(t: StepBytes, live: MemoryBreakdown) -> MemoryBreakdown:
    """A plain micro-batch's event ``live`` in a later micro-batch of synced accumulation, but
    for the sharded gradients carried in: only its unsharded gradients, since its reductions
    are added into the carried shards (a reduce-scatter output is added in after the
    collective, past the event's peak; FSDP2's head gradient, waiting unsharded in the root, is
    one of them). Offloaded, the shards are on the host: the event as it is."""
    if not t.grad_shard_bytes:
        return live
    block_grads = t.grad_shard_bytes - t.trained_root_params * t.stored_dtype_bytes // t.shard
    waiting = min(t.head_grad_bytes, live.gradients)
    unsharded = max(0, live.gradients - waiting - block_grads) + waiting
    return live.model_copy(update={"gradients": unsharded})
