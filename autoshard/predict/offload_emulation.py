"""FSDP1's CPU offload run for real on CPU processes, its device bytes told apart from its host
bytes: what the estimate of an offloading FSDP1 candidate is checked against where there is no
GPU (``tests/predict/test_offload_emulation.py``, ``benchmarks/offload_fsdp1.py``).

torch runs FSDP1's offload only with an accelerator (torch 2.13, CPU-only build). Three places
differ on a CPU process, each set right for the duration of :func:`offload_on_cpu`:

- ``Tensor.pin_memory`` needs an accelerator (FSDP1 pins each unit's host shard and its host
  gradient, ``FlatParamHandle.init_flat_param_attributes``): on the CPU it is the tensor itself;
- ``torch.cpu.Stream`` has no ``synchronize`` (the root's post-backward callback waits on the
  device-to-host gradient copies with it): CPU work is done when it returns;
- ``FlatParamHandle.pre_unshard`` moves an offloaded shard to the compute device with
  ``flat_param_to(device)`` only when the shard is not on it already: on a GPU that is a new
  device tensor per unit and per pre-forward/pre-backward, on the CPU ``.to(cpu)`` is the tensor
  itself and nothing would be copied. Here the move is made a copy whenever the flat parameter
  is the host shard (``_local_shard``): exactly the GPU's condition, since FSDP1 points the flat
  parameter back at the host shard on every reshard.

Everything else is torch's own FSDP1 code, unchanged. The host side is what FSDP1 keeps on the
host by design: each unit's shard (``_local_shard``), its host gradient (``_cpu_grad``) and the
optimizer's states (made on the host by the first step); every other storage is the device's
(:class:`DeviceBytes` counts each as it is made and freed; the peak is replayed without the host
storages once they are known). What the emulation cannot see: the allocator's rounding, the
transient full-precision copy a mixed-precision unit casts from on the device
(``_use_low_precision_shard``: ``.to(device)`` then a cast), NCCL's buffers.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autoshard.config import Candidate, WorkloadSpec
from autoshard.predict.tracking import warnings_off

if TYPE_CHECKING:
    from autoshard.target.resolve import TargetSpec


@contextlib.contextmanager
def offload_on_cpu() -> Iterator[None]:
    """Within the block, FSDP1 runs ``CPUOffload(offload_params=True)`` on CPU processes with a
    real host-to-device copy per unshard (the module's docstring says what is set right)."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    pin = torch.Tensor.pin_memory
    pre_unshard = FlatParamHandle.pre_unshard
    had_sync = hasattr(torch.cpu.Stream, "synchronize")

    def moved_to_device(handle: Any) -> bool:
        ran = pre_unshard(handle)
        flat = handle.flat_param
        if handle._offload_params and _same_storage(flat, flat._local_shard):
            handle.flat_param_to(handle.device, non_blocking=True, copy=True)
            return True
        return bool(ran)

    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    FlatParamHandle.pre_unshard = moved_to_device  # type: ignore[method-assign, assignment]
    if not had_sync:
        torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        torch.Tensor.pin_memory = pin  # type: ignore[method-assign]
        FlatParamHandle.pre_unshard = pre_unshard  # type: ignore[method-assign]
        if not had_sync:
            del torch.cpu.Stream.synchronize  # type: ignore[attr-defined]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


class DeviceBytes(TorchDispatchMode):
    """The device's bytes while the mode is on: every storage an operation makes or touches,
    but the ``host`` ones, summed at their current size after each operation (FSDP1 frees and
    re-allocates a unit's storage by resizing it, which no operation shows), and their most."""

    def __init__(self, host: set[int], resident: list[torch.Tensor]) -> None:
        super().__init__()
        self.host = host
        self.storages: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.phase = ""
        self.peak, self.peak_at = 0, ""
        self.made: dict[int, str] = {}
        self.at_peak: list[tuple[int, str]] = []
        for tensor in resident:
            self._add(tensor, "resident")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves((out, args, kwargs)):
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, f"{self.phase}: {func}")
        alive = 0
        for key, ref in list(self.storages.items()):
            storage = ref()
            if storage is None:
                del self.storages[key]
            else:
                alive += storage.nbytes()
        if alive > self.peak:
            self.peak, self.peak_at = alive, f"{self.phase}: {func}"
            self.at_peak = [
                (st.nbytes(), self.made[key])
                for key, ref in self.storages.items()
                if (st := ref()) is not None
            ]
        return out

    def _add(self, tensor: torch.Tensor, where: str) -> None:
        storage = tensor.untyped_storage()
        if storage._cdata not in self.host and storage._cdata not in self.storages:
            self.storages[storage._cdata] = weakref.ref(storage)
            self.made[storage._cdata] = where


def host_storages(model: nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """The storages FSDP1's offload keeps on the host: each unit's shard and host gradient, and
    the optimizer's states."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    kept: list[Any] = []
    for module in FullyShardedDataParallel.fsdp_modules(model):
        handle = getattr(module, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        kept += [getattr(flat, name, None) for name in ("_local_shard", "_cpu_grad")]
    for state in optimizer.state.values():
        kept += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return {t.untyped_storage()._cdata for t in kept if isinstance(t, torch.Tensor)}


def fsdp1_state(model: nn.Module) -> list[torch.Tensor]:
    """The tensors FSDP1 holds for its units between steps (the flat parameters, the views and
    copies each handle keeps, their gradients) and the model's buffers."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    names = ("_full_param_padded", "_mp_shard", "_saved_grad_shard", "_cpu_grad", "_local_shard")
    held: list[Any] = list(model.buffers())
    for module in FullyShardedDataParallel.fsdp_modules(model):
        handle = getattr(module, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        held += [flat, flat.grad, *getattr(flat, "_tensors", ())]
        held += [getattr(flat, name, None) for name in names]
    return [t for t in held if isinstance(t, torch.Tensor)]


class OffloadPeak(NamedTuple):
    """The device's peak of an emulated offload run: its bytes, the step and operation it was
    reached at, and each storage alive then (bytes, the step and operation that made it;
    "resident": held from before the counted steps)."""

    bytes: int
    at: str
    alive: list[tuple[int, str]]


def measure_offload_peak(
    target: TargetSpec, candidate: Candidate, workload: WorkloadSpec, *, steps: int = 3
) -> OffloadPeak:
    """The device's peak of an offloading FSDP1 ``candidate``'s training steps on this rank of
    an initialised gloo process group, built and stepped as a trial does. The first step (not
    counted) makes every unit's host gradient and the optimizer's states; the ``steps - 1``
    counted after it start from what the steps before them left on the device (FSDP1's state
    is taken stock of first)."""
    from autoshard.loop import autocast_for, optimizer_step
    from autoshard.trials.worker import build_for_training

    device = torch.device("cpu")
    with offload_on_cpu(), warnings_off():
        model, optimizer, batch, loss_fn = build_for_training(
            target, candidate, device, workload.seq_len
        )
        autocast = autocast_for(candidate, device)

        def step() -> None:
            optimizer_step(model, optimizer, batch, workload, autocast=autocast, loss_fn=loss_fn)

        step()
        inputs = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor)]
        ledger = DeviceBytes(host_storages(model, optimizer), fsdp1_state(model) + inputs)
        del inputs  # a reference kept here would keep what it names alive
        with ledger:
            for n in range(1, steps):
                ledger.phase = f"step {n}"
                step()
        return OffloadPeak(ledger.peak, ledger.peak_at, ledger.at_peak)
