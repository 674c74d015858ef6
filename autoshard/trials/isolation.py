"""A trial leaves nothing of itself in its worker: what held a finished trial, how the worker lets
it go, and how much memory a trial starts from.

A worker group runs trial after trial in the same processes, so whatever a trial leaves
reachable is allocated under the next one: its peak reads high and a candidate that fits runs
out of memory. Measured on one H200 (``gpu-runs/2026-11-28-h200``), each FSDP1 trial left its
flat parameters and their gradients (~8 GiB for a 1.1B-parameter model in fp32, a 7B model's
after the first trial of a tune: four false OOMs).

The holder: FSDP1 keeps, in attributes of each ``FlatParameter``, the modules it flattened and
the views of itself it hands them (``_param_infos``, ``_modules``, ``_tensors``). A view keeps
its base alive from C++ (its autograd edge to the flat parameter's ``AccumulateGrad``, which
holds the flat parameter), and torch's collector support treats a tensor that C++ also owns as a
root (``THPVariable_subclass_traverse``; pytorch/pytorch#7343): the cycle flat parameter ->
its attributes -> view -> flat parameter is never collected once the model is dropped
(pytorch/pytorch#183211 and #182774 describe the same cycle). It forms where the unsharded views
stay after a step: ``NO_SHARD``, which FSDP1 runs for every strategy at world size 1 (the H200
run), and what was measured here on gloo; a sharded FSDP1 reshards back to views of its local
shard without autograd edges, and FSDP2 keeps no such attributes (both left nothing here).
:func:`dismantle` breaks the cycle when a trial ends, however it ended.

The defence behind it: the worker reads how much is allocated before each trial and after its
release (:func:`live_bytes`: CUDA's allocator, or on CPU the tensors Python can reach), and the
driver restarts the group when a trial's leftover is not back to the group's first level within
:func:`leftover_margin` (:mod:`autoshard.trials.group`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import warnings
from typing import Any

import torch
from torch import nn

# A trial's leftover within this (or LEFTOVER_SHARE of its own peak, if more) is not a leak:
# lazily made constants and caches of torch and the model's code. A leak worth a restart is a
# model's worth of tensors.
LEFTOVER_FLOOR = 4 * 2**20
LEFTOVER_SHARE = 0.01


def dismantle(model: nn.Module | None) -> None:
    """Break the reference cycles that keep ``model``'s FSDP1 flat parameters (with their
    gradients, local shards and the modules they flattened) alive after the model is dropped:
    each ``FlatParameter``'s own attributes, FSDP's bookkeeping, which the cycle runs through
    (see the module docstring). Only at a trial's end: the model is unusable afterwards."""
    if model is None:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._flat_param import FlatParameter

    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = getattr(unit, "_handle", None)
        flat = getattr(handle, "flat_param", None)
        if isinstance(flat, FlatParameter):
            flat.grad = None
            flat.__dict__.clear()


def release(device: torch.device) -> int:
    """Free what nothing reaches any more, hand it back (CUDA's cache and cuBLAS workspaces,
    glibc's free heap pages), and return the bytes still allocated: the level the next trial
    starts from (:func:`live_bytes`)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # frees waiting on streams' events are done
        # cuBLAS keeps a workspace per handle and stream in the allocator: a trial's own, as in
        # a fresh process (torch's CudaMemoryLeakCheck clears them the same way)
        with contextlib.suppress(AttributeError, RuntimeError):
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
    else:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    return live_bytes(device)


def freeze_process(device: torch.device) -> None:
    """Release, then move every object alive now out of the collector's sight (``gc.freeze``):
    called when a worker has joined its group, and again before its first trial is measured,
    after that trial's warm-ups: when what is alive is the process's own (imports, the
    communicator, the target's module), never a trial's. Each later collection and
    :func:`live_bytes` scan then walks what was made since, not the ~255,000 objects of torch's
    import: measured here on a loaded 2-core machine, a release took 1.3 s before and under
    0.01 s after."""
    release(device)
    gc.freeze()


def live_bytes(device: torch.device) -> int:
    """Bytes of tensors allocated now on ``device``: CUDA's ``memory_allocated``; on CPU, the
    storages of every tensor Python can reach (and their gradients), each storage once."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a parameter's .grad of a wrapper subclass may warn
        for obj in gc.get_objects():
            # by type, not isinstance: no object's __class__ (a proxy, a lazy module) is run
            if issubclass(type(obj), torch.Tensor):
                total += _storage_bytes(obj, seen)
                grad = obj.grad if obj.is_leaf else None
                total += _storage_bytes(grad, seen) if grad is not None else 0
    return total


def _storage_bytes(tensor: Any, seen: set[int]) -> int:
    """The bytes of ``tensor``'s CPU storage the first time it is met (views share one), 0 for
    meta and fake tensors and for subclasses without a storage of their own (a DTensor's local
    tensor is met by itself)."""
    try:
        if tensor.device.type != "cpu":
            return 0
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
    except Exception:  # a DTensor's ("invalid python storage"), any subclass's: a count, no crash
        return 0
    if key in seen or key == 0:
        return 0
    seen.add(key)
    return int(storage.nbytes())


def leftover_margin(peak: int | None) -> int:
    """How far above the group's first level a trial's leftover may be and still be taken as
    none: :data:`LEFTOVER_FLOOR`, or :data:`LEFTOVER_SHARE` of the trial's peak if more."""
    return max(LEFTOVER_FLOOR, int(LEFTOVER_SHARE * (peak or 0)))


def worst_excess(levels: tuple[int, ...], clean: tuple[int, ...]) -> tuple[int, int]:
    """(rank, bytes) of the rank furthest above its clean level (bytes <= 0: none is above);
    (0, 0) when either is unknown (an older worker, a failed read)."""
    if not levels or len(levels) != len(clean):
        return 0, 0
    excess = [level - base for level, base in zip(levels, clean, strict=True)]
    rank = max(range(len(excess)), key=excess.__getitem__)
    return rank, excess[rank]
