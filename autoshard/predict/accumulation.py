"""The memory moments of gradient accumulation (:mod:`autoshard.predict.loop_moments`): the
later micro-batches run beside the earlier ones' gradients, kept unsharded when the sync is
skipped (:func:`no_sync_moments`) or reduced into the sharded gradients
(:func:`synced_accumulation_moments`).
"""

from __future__ import annotations

from autoshard.config import Candidate, Engine, Hardware
from autoshard.engine import (
    as_run,
    element_bytes,
    gradient_params,
    policy_of,
    reduce_bytes,
    shard_size,
    traits,
)
from autoshard.predict.activations import ActivationProfile
from autoshard.predict.moments import backward_start_moments
from autoshard.predict.step_bytes import (
    fsdp2_head_gradient,
    head_params,
    last_block_all_activations,
)
from autoshard.results import MemoryBreakdown, ModelProfile


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

    Measured on fake tensors: a non-final micro-batch's block backward holds its
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
    trained_root = gradient_params(profile, candidate)[1]
    head = moments["head backward"]
    out = {
        f"accumulating {name}": m.model_copy(update={"gradients": m.gradients + kept})
        for name, m in {**forward, "loss": moments["loss"]}.items()
    }
    # The head's backward: its weight's fresh gradient (one tensor) beside the logits' gradient
    # before it joins the kept one; FSDP2 holds the root gathered, also with NO_SHARD.
    root_params = profile.total_params if candidate.one_unit else profile.root_unit_params
    fsdp2_root = root_params * cb if candidate.engine is Engine.FSDP2 else 0
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
    out.update(_no_sync_unit_backwards(head, profile, candidate, hardware, acts, kept))
    out.update(
        backward_start_moments(
            head_kept, "accumulating ", moments, profile, candidate, hardware, acts
        )
    )
    out.update(_last_no_sync_moments(moments, profile, candidate, hardware, acts, kept))
    return out


def _no_sync_unit_backwards(
    head: MemoryBreakdown,
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    acts: ActivationProfile,
    kept: int,
) -> dict[str, MemoryBreakdown]:
    """A block's and the root's backward in a micro-batch that skips the sync
    (:func:`no_sync_moments`; ``candidate`` as run, ``head`` its head-backward moment): each
    unit's fresh gradients beside the ``kept`` ones, the head's gradient waiting in the root."""
    _, cb = element_bytes(candidate.precision)
    _, trained_root, trained_unit = gradient_params(profile, candidate)
    upcast = _upcasts_gradients(candidate)
    at = acts.at(candidate.precision)
    scale = at.scale(candidate)
    last = int(at.block_bytes[-1] * scale) if at.block_bytes else 0
    through_blocks = head.activations  # saved, less the loss's log-probabilities
    root_params = profile.total_params if candidate.one_unit else profile.root_unit_params
    gathers = shard_size(candidate, hardware) > 1 or candidate.precision.mixed
    # the head's gradient waits in the root unit for its flat gradient (FSDP1) or its upcast
    # (FSDP2 mixed); FSDP2 without an upcast adds it into the kept gradient at once
    waits = candidate.engine is Engine.FSDP1 or upcast
    head_grad = head_params(profile) * cb if trained_root and waits else 0
    gathered_units, buffers = _no_sync_gathered(profile, candidate, hardware)
    keeps_all = traits(candidate).keeps_gathered
    base = head.model_copy(update={"comm_buffers": 0, "temporaries": 0, "gradients": kept})
    out = {}
    if not candidate.one_unit:
        out["accumulating block backward"] = base.model_copy(
            update={
                "unsharded_params": gathered_units,
                "comm_buffers": buffers,
                "activations": through_blocks - last,
                "temporaries": head_grad + _fresh_gradients(candidate, trained_unit),
            }
        )
    out["accumulating root backward"] = base.model_copy(
        update={
            "unsharded_params": gathered_units if keeps_all else root_params * cb if gathers else 0,
            "activations": int(at.other_bytes * scale),
            "temporaries": _fresh_gradients(candidate, trained_root),
        }
    )
    return out


def _upcasts_gradients(candidate: Candidate) -> bool:
    """FSDP2 under mixed precision with an fp32 reduce upcasts each unit's gradients to fp32."""
    mixed = candidate.precision.mixed
    return candidate.engine is Engine.FSDP2 and mixed and candidate.reduce_dtype_fp32


def _fresh_gradients(candidate: Candidate, n: int) -> int:
    """Bytes of a unit's new gradients (``n`` parameters) before they join the kept ones."""
    _, cb = element_bytes(candidate.precision)
    if candidate.engine is Engine.FSDP1:
        return 2 * n * cb
    # FSDP2 without an upcast: autograd adds into the kept gradient in place
    return n * cb + n * 4 if _upcasts_gradients(candidate) else 0


def _no_sync_gathered(
    profile: ModelProfile, candidate: Candidate, hardware: Hardware
) -> tuple[int, int]:
    """(bytes of the units gathered, of the all-gather buffers) in a block's backward of a
    micro-batch that skips the sync; ``candidate`` as run."""
    _, cb = element_bytes(candidate.precision)
    unit_params = 0 if candidate.one_unit else profile.block_params
    root_params = profile.total_params if candidate.one_unit else profile.root_unit_params
    gathers = shard_size(candidate, hardware) > 1 or candidate.precision.mixed
    if candidate.engine is Engine.FSDP1:
        gathered_units = (root_params + 2 * unit_params) * cb if gathers else 0
        buffers = 0
    else:
        gathered_units = (root_params + unit_params) * cb if gathers else 0
        buffers = unit_params * cb if shard_size(candidate, hardware) > 1 else 0
    if traits(candidate).keeps_gathered:
        gathered_units = profile.total_params * cb  # nothing is freed between micro-batches
    return gathered_units, buffers


def _last_no_sync_moments(
    moments: dict[str, MemoryBreakdown],
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    acts: ActivationProfile,
    kept: int,
) -> dict[str, MemoryBreakdown]:
    """The last micro-batch after skipped syncs (:func:`no_sync_moments`; ``candidate`` as
    run): the top block reduces its gradients (and gloo copies the reduce input) while every
    other unit's ``kept`` gradients are still unsharded."""
    out = {}
    trained_unit = gradient_params(profile, candidate)[2]
    keeps_all = traits(candidate).keeps_gathered
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
    if candidate.engine is Engine.FSDP1 and not candidate.one_unit and not keeps_all:
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
    worst block is where the stored gradients above outgrow the activations freed
    (provenance: benchmarks/results/memory_moments.md)."""
    stored, cb = element_bytes(candidate.precision)
    shard = shard_size(candidate, hardware)
    _, _, trained_unit = gradient_params(profile, candidate)
    at = acts.at(candidate.precision)
    scale = at.scale(candidate)
    mixed = candidate.precision.mixed
    gathers = shard > 1 or mixed
    root_params = profile.root_unit_params
    unit_params = profile.block_params
    blocks = max(profile.block_count, 1)
    reduced = trained_unit * stored // shard  # one unit's stored gradient
    worst: MemoryBreakdown | None = None
    freed = 0
    for j in range(blocks):
        freed += int(at.block_bytes[blocks - 1 - j] * scale) if j < len(at.block_bytes) else 0
        moment = sync.model_copy(
            update={
                # FSDP1 keeps the root gathered; the block and the next one prefetched
                "unsharded_params": (root_params + (2 if j < blocks - 1 else 1) * unit_params) * cb
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
    stored, _ = element_bytes(candidate.precision)
    shard = shard_size(candidate, hardware)
    sharded_grads = moments["optimizer step"].gradients
    _, trained_root, _ = gradient_params(profile, candidate)
    block_grads = moments["optimizer step"].gradients - trained_root * stored // shard
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
    out.update(
        backward_start_moments(
            out["accumulating head backward"],
            "accumulating ",
            moments,
            profile,
            candidate,
            hardware,
            acts,
        )
    )
    if candidate.engine is Engine.FSDP2:
        out.update(_fsdp2_synced_moments(out, moments, profile, candidate, hardware, acts))
    return out


def _fsdp2_synced_moments(
    accumulating: dict[str, MemoryBreakdown],
    moments: dict[str, MemoryBreakdown],
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    acts: ActivationProfile,
) -> dict[str, MemoryBreakdown]:
    """FSDP2's own moments of synced accumulation (:func:`synced_accumulation_moments`, whose
    ``accumulating`` moments they add to or replace; ``candidate`` as run)."""
    _, cb = element_bytes(candidate.precision)
    shard = shard_size(candidate, hardware)
    sharded_grads = moments["optimizer step"].gradients
    _, trained_root, trained_unit = gradient_params(profile, candidate)
    reduce = reduce_bytes(candidate)
    out = {}
    if not candidate.one_unit:
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
    if traits(candidate).replicates:
        # With a replicate dimension every unit's reduced gradients wait until backward ends
        # before they are added into the sharded ones (measured on fake tensors: a second set
        # of gradients builds up through backward).
        step = moments["optimizer step"]
        unit_params = 0 if candidate.one_unit else profile.block_params
        root_params = profile.total_params if candidate.one_unit else profile.root_unit_params
        out["accumulating backward end"] = step.model_copy(
            update={
                # FSDP2 gathers copies, also at 1 shard
                "unsharded_params": (root_params + unit_params) * cb,
                "gradients": sharded_grads
                + gradient_params(profile, candidate)[0] * reduce // shard,
                "temporaries": 0,
                "activations": moments["root backward"].activations,
            }
        )
        m = accumulating["accumulating root backward"]
        waiting = (gradient_params(profile, candidate)[0] - trained_root) * reduce // shard
        out["accumulating root backward, reduced gradients waiting"] = m.model_copy(
            update={"gradients": m.gradients + waiting}
        )
    if shard == 1 and reduce == cb:
        # FSDP2 copies the gradients into a reduce-scatter input even over a shard dimension
        # of 1 (NO_SHARD replicates on a (world, 1) mesh), then all-reduces; peak_moments
        # counts that copy only where it casts
        m = accumulating["accumulating root backward"]
        out["accumulating root backward"] = m.model_copy(
            update={"comm_buffers": m.comm_buffers + trained_root * reduce}
        )
    return out
