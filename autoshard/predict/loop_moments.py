"""The memory moments the user's loop adds to those of one plain step
(:mod:`autoshard.predict.moments`): the forward's own moments, Lightning's order (the last step's
gradients alive through the next forward), and gradient accumulation, with the sync skipped
(:func:`no_sync_moments`) or not (:func:`synced_accumulation_moments`).
"""

from __future__ import annotations

from autoshard.config import Candidate, Engine, Hardware, Loop, Reshard, Sharding, WorkloadSpec
from autoshard.engine import (
    as_run,
    element_bytes,
    gradient_params,
    policy_of,
    reduce_bytes,
    shard_size,
    skips_gradient_sync,
)
from autoshard.predict.activations import ActivationProfile
from autoshard.predict.step_bytes import (
    fsdp2_head_gradient,
    head_params,
    last_block_all_activations,
)
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
    head_grad = head_params(profile) * cb if trained_root and waits else 0

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
            "temporaries": head.temporaries + (head_params(profile) * cb if trained_root else 0)
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
                "activations": head.activations - 2 * last_block_all_activations(candidate, acts),
                "temporaries": head_params(profile) * cb * (trained_root > 0)
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
