"""torch's memory trackers around a training step, on fake or real tensors.

The simulation (:mod:`autoshard.predict.simulate`) runs them on fake tensors; the accuracy
benchmark and its tests (:func:`measure_training_peak`) on real ones in real gloo processes, so
both count bytes the same way. ``FSDPMemTracker`` for FSDP2, ``MemTracker`` for FSDP1 (with the
two corrections below), both kept to their global peak (:func:`_global_peak_only`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autoshard.config import Candidate, Engine, WorkloadSpec
from autoshard.loop import autocast_for, optimizer_step

if TYPE_CHECKING:
    from autoshard.target.resolve import TargetSpec

# Steps tracked: the first creates the optimizer state, the second runs with it in memory.
TRACKED_STEPS = 2
LOOP_PHASE, STEP_PHASE = "forward and backward", "optimizer step"


def _fsdp1_tracker() -> Any:
    from torch.distributed._tools.mem_tracker import MemTracker

    class FSDP1MemTracker(MemTracker):
        """MemTracker for FSDP1 with ``use_orig_params=True``: the original parameters are views
        into flat parameters during forward, and a view cannot take a post-accumulate-grad hook.
        Gradients are still counted (every allocation is), only not labelled as gradients."""

        def _track_module_params_and_buffers(
            self, module: nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            leaf = all(p.is_leaf for p in module.parameters())
            result: tuple[int, int] = super()._track_module_params_and_buffers(
                module, install_grad_hooks and leaf and _all_trainable(module)
            )
            if install_grad_hooks and leaf:
                _label_gradients(self, module)
            return result

    return FSDP1MemTracker()


def _fsdp2_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    from torch._guards import active_fake_mode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.tensor import DTensor

    wait = torch.ops._c10d_functional.wait_tensor.default

    class PropagationUntracked(FSDPMemTracker):
        """FSDPMemTracker without DTensor's sharding propagation: the propagation runs each
        operation in a fake mode of its own for the output's metadata, and only the local
        operation on the shard allocates. torch 2.13's tracker leaves it out itself; torch
        2.11's counted it, and an FSDP2 optimizer step's simulated peak was 2.2x (the same for
        every checkpointing: tests/predict/test_analytic.py on torch 2.11)."""

        def __enter__(self) -> Any:
            if self._depth == 0:
                self._entry_fake_mode = active_fake_mode()
            return super().__enter__()

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            nested = active_fake_mode() is not self._entry_fake_mode
            if nested and func is not wait and not any(t is DTensor for t in types):
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return PropagationUntracked(model, optimizer)


def _all_trainable(module: nn.Module) -> bool:
    return all(p.requires_grad for p in module.parameters())


def _label_gradients(tracker: Any, module: nn.Module) -> None:
    """Label the gradients of the trainable parameters of a module that also holds frozen ones.

    torch's ``MemTracker`` hooks every parameter, and ``register_hook`` refuses a tensor that
    does not require grad ("cannot register a hook on a tensor that doesn't require gradient"):
    frozen parameters (fine-tuning, LoRA) get no hook, the trainable ones get the tracker's."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    if _all_trainable(module):
        return  # the tracker hooked them itself
    handles = tracker._param_to_grad_hook_handles
    for param in module.parameters():
        if not param.requires_grad or handles.get(param) is not None:
            continue

        def label(grad: torch.Tensor) -> None:
            tracker._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        handles[param] = (
            param.register_hook(label),
            param.register_post_accumulate_grad_hook(lambda p, label=label: label(p.grad)),
        )


def track_training_peak(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    candidate: Candidate,
    *,
    loss_fn: Any = None,
    steps: int = TRACKED_STEPS,
    workload: WorkloadSpec | None = None,
) -> dict[str, int]:
    """Run ``steps`` optimizer steps, in the order of ``workload``'s loop and with its
    accumulation (:func:`autoshard.loop.optimizer_step`), under torch's memory tracker; the
    per-kind bytes at the peak (key ``"Total"`` is the peak itself). Works on fake and on real
    tensors alike."""
    phases = track_training_phases(
        model, optimizer, batch, candidate, loss_fn=loss_fn, steps=steps, workload=workload
    )
    return max(phases.values(), key=lambda kinds: kinds.get("Total", 0))


def track_training_phases(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    candidate: Candidate,
    *,
    loss_fn: Any = None,
    steps: int = TRACKED_STEPS,
    workload: WorkloadSpec | None = None,
) -> dict[str, dict[str, int]]:
    """:func:`track_training_peak`, phase by phase: the per-kind bytes at the peak of the
    optimizer steps and at the peak of the rest of the loop (forward and backward), each the
    larger over the steps. Phases grow at different rates with depth, so a simulation of a
    few blocks extrapolates each on its own (:func:`simulate_memory`)."""
    sharded = 0
    workload = workload or WorkloadSpec()
    if candidate.engine is Engine.FSDP2:
        tracker: Any = _fsdp2_tracker(model, optimizer)
        tracker.track_inputs((batch,))
    else:
        sharded = _fsdp1_shard_bytes(model)
        tracker = _fsdp1_tracker()
        tracker.track_external(model, optimizer, batch)
    _global_peak_only(tracker)
    device = training_device(model, batch)
    autocast = autocast_for(candidate, device)
    phases: dict[str, dict[str, int]] = {}

    def close(phase: str) -> None:
        # the phase's peak, then a fresh peak from the current bytes for the next phase
        snapshot = device_snapshot(tracker.get_tracker_snapshot("peak"), device)
        kinds = {str(getattr(k, "value", k)): int(v) for k, v in snapshot.items()}
        if kinds.get("Total", 0) > phases.get(phase, {}).get("Total", -1):
            phases[phase] = kinds
        _restart_peak(tracker)

    hooks = [
        optimizer.register_step_pre_hook(lambda *_: close(LOOP_PHASE)),
        optimizer.register_step_post_hook(lambda *_: close(STEP_PHASE)),
    ]
    try:
        with tracker, warnings_off():
            for _ in range(steps):
                # the user's loop order and accumulation (autoshard.loop); per-module stats are
                # reset before a module runs again, the global peak is kept
                optimizer_step(
                    model,
                    optimizer,
                    batch,
                    workload,
                    autocast=autocast,
                    loss_fn=loss_fn,
                    after_micro_batch=tracker.reset_mod_stats,
                )
                tracker.reset_mod_stats()
            close(LOOP_PHASE)
    finally:
        for hook in hooks:
            hook.remove()
    if candidate.engine is Engine.FSDP1:
        phases = {phase: _split_fsdp1_params(kinds, sharded) for phase, kinds in phases.items()}
    return phases


def training_device(model: nn.Module, batch: Any) -> torch.device:
    """The device a step computes on: the batch's (its first tensor), else the parameters'."""
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    return next(model.parameters()).device


def device_snapshot(snapshots: dict[Any, dict[Any, int]], device: torch.device) -> dict[Any, int]:
    """The trackers' per-kind bytes of ``device`` among their per-device snapshots. On a GPU
    they book a second device: the optimizer's step counters stay on the CPU (torch's Adam and
    AdamW, not capturable), and the CPU's bytes are not the GPU's peak. A device given without
    an index (``cuda``) is the one of its type the tracker saw."""
    device = torch.device(device)
    same = [
        snap
        for dev, snap in snapshots.items()
        if torch.device(dev).type == device.type
        and (device.index is None or torch.device(dev).index in (None, device.index))
    ]
    if len(same) != 1:
        seen = ", ".join(str(dev) for dev in snapshots) or "none"
        raise RuntimeError(f"memory tracker: no single snapshot of {device} (devices: {seen})")
    return same[0]


def _global_peak_only(tracker: Any) -> None:
    """Keep only the tracker's global peak up to date at each operation.

    torch's trackers also keep each module's peak: at every operation they walk every module
    tracked so far (``MemTracker._update_peak_stats``, torch 2.13), which made simulating a
    64-block model take longer than 15 minutes (about half of a 9-block simulation's time,
    profiled). Nothing here reads the per-module peaks."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    def update(_peak_state: Any) -> None:
        for dev, snap in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                tracker._peak_mem[dev] = snap[_TOTAL_KEY]
                tracker._peak_mem_snap[dev] = dict(snap)  # a flat dict of byte counts

    tracker._update_peak_stats = update


def _restart_peak(tracker: Any) -> None:
    # torch's trackers keep one peak for their whole run and have no reset (torch 2.13): start
    # it again from the current bytes, as their __enter__ does.
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    tracker._peak_mem_snap = tracker.get_tracker_snapshot()
    tracker._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in tracker._peak_mem_snap.items()}


def _fsdp1_shard_bytes(model: nn.Module) -> int:
    """Bytes of this rank's FSDP1 flat-parameter shards, taken before the first forward, while
    every flat parameter still holds its shard (NO_SHARD: the whole parameter)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    total = 0
    for module in FullyShardedDataParallel.fsdp_modules(model):
        handle = getattr(module, "_handle", None)
        if handle is not None:
            flat = handle.flat_param
            total += flat.numel() * flat.element_size()
    return total


def _split_fsdp1_params(kinds: dict[str, int], sharded: int) -> dict[str, int]:
    """FSDP1's tracker books the gathered flat parameters (SHARD_GRAD_OP keeps the whole model
    gathered through forward and backward; FULL_SHARD the root and a unit or two; mixed
    precision's low-precision copies) as "Parameter", with the shards: at the peak the shards
    are all alive, so whatever is above their bytes is gathered."""
    params = kinds.pop("Parameter", 0)
    kinds["Sharded Param"] = kinds.get("Sharded Param", 0) + min(params, sharded)
    kinds["Unsharded Param"] = kinds.get("Unsharded Param", 0) + max(0, params - sharded)
    return kinds


def measure_training_peak(
    target: TargetSpec, candidate: Candidate, workload: WorkloadSpec, device: torch.device
) -> dict[str, int]:
    """What :func:`simulate_memory` predicts, measured: build and shard ``candidate`` for real on
    this rank of an initialised process group, as a trial does, and track two training steps.
    Every rank must call it; each gets its own peak."""
    from autoshard.trials.worker import (
        build_for_training,  # the worker's module, not loaded on import
    )

    with warnings_off():
        model, optimizer, batch, loss_fn = build_for_training(
            target, candidate, device, workload.seq_len
        )
        return track_training_peak(
            model, optimizer, batch, candidate, loss_fn=loss_fn, workload=workload
        )


@contextlib.contextmanager
def warnings_off() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
