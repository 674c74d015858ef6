"""The fake world a simulation runs in: a ``"fake"`` process group of any size, and the few
places where torch's FSDP, DTensor or gloo behave differently on fake tensors than on real ones,
each set right for the duration of a simulation (torch 2.13)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard.errors import ConfigError


@contextlib.contextmanager
def fake_world(world_size: int, backend: str = "nccl", rank: int = 0) -> Iterator[None]:
    """A ``"fake"`` default process group of ``world_size`` ranks (this process is ``rank``),
    whose collectives allocate what ``backend``'s do (NCCL's and the fake group's: nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError(
            "simulate_memory needs a process without a process group; call it before "
            "init_process_group (or from a separate process)"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        with (
            _sharding_propagation_outside_fake_mode(),
            _collective_buffers(backend),
            _gloo_holds_the_waited_all_gather(backend),
        ):
            yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fsdp1_allocation_check_on_fakes() -> Iterator[None]:
    # FSDP1's write-back of the original parameters (SHARD_GRAD_OP with use_orig_params=True)
    # asserts that the unsharded flat parameter is allocated by its storage's data pointer,
    # which a fake tensor's storage does not have (0): "If skipped using sharded views, the
    # unsharded flat parameter should be allocated" (torch 2.13). A freed flat parameter's
    # storage is resized to 0 bytes, so its size says the same on fake and real tensors.
    import torch.distributed.fsdp._flat_param as flat_param

    original = flat_param._data_ptr_allocated
    flat_param._data_ptr_allocated = lambda tensor: tensor.untyped_storage().nbytes() > 0
    try:
        yield
    finally:
        flat_param._data_ptr_allocated = original


@contextlib.contextmanager
def no_op_moves_skipped() -> Iterator[None]:
    # On fake tensors Module._apply swaps every parameter (torch.utils.swap_tensors), also for a
    # Module.to() that changes nothing, and the swap fails ("Cannot swap t2 because it has
    # weakref associated with it"). peft moves each new LoRA adapter to its base layer's device
    # and dtype that way, where it already is: such a move is skipped during the build.
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if memory_format is None and all(
            (device is None or t.device == torch.device(device))
            and (dtype is None or not t.is_floating_point() or t.dtype == dtype)
            for t in tensors
        ):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[assignment]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _collective_buffers(backend: str) -> Iterator[None]:
    # gloo's reduce-scatter works on a copy of its input (ProcessGroupGloo; +1x the input under
    # torch's tracker around a bare 2-process collective; all-gather and all-reduce add nothing).
    # Both engines call ``dist.reduce_scatter_single`` (``reduce_scatter_tensor`` before torch
    # 2.13), looked up at call time.
    if backend != "gloo":
        yield
        return
    name = next(n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n))
    original = getattr(dist, name)

    def reduce_scatter_on_a_copy(output: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
        return original(output, input.clone(), *args, **kwargs)  # the copy dies on return

    setattr(dist, name, reduce_scatter_on_a_copy)
    try:
        yield
    finally:
        setattr(dist, name, original)


@contextlib.contextmanager
def _gloo_holds_the_waited_all_gather(backend: str) -> Iterator[None]:
    # gloo's worker thread drops its reference to a collective's tensors only after it has
    # woken the thread waiting on it (ProcessGroupGloo's run loop). FSDP2's pre-backward hook of
    # a unit that was not prefetched (the root, re-gathered when backward starts) waits on its
    # all-gather as soon as it is issued, copies it out, frees the output and at once allocates
    # the next unit's all-gather (its prefetch): the output can still be alive then (a race,
    # measured on 2 gloo processes: 4 ranks of 4 and 5 ranks of 6 on a LoRA Llama; a 20 ms pause
    # before the prefetch removes it). The fake process group never holds it: its worst case is
    # planned here, the output kept until the hook returns. An all-gather prefetched earlier
    # completed long before it is copied out, and forward keeps its outputs on purpose.
    if backend != "gloo":
        yield
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    original = FSDPParamGroup.pre_backward

    def pre_backward(self: Any, default_prefetch: bool, *unused: Any) -> Any:
        if self._training_state == TrainingState.PRE_BACKWARD or self._all_gather_result:
            return original(self, default_prefetch, *unused)  # a no-op, or prefetched
        held = []
        unshard = self.unshard

        def unshard_and_hold(*args: Any, **kwargs: Any) -> Any:
            out = unshard(*args, **kwargs)
            held.append(self._all_gather_result)
            return out

        self.unshard = unshard_and_hold
        try:
            return original(self, default_prefetch, *unused)
        finally:
            del self.unshard  # the class's method again
            held.clear()

    FSDPParamGroup.pre_backward = pre_backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        FSDPParamGroup.pre_backward = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _sharding_propagation_outside_fake_mode() -> Iterator[None]:
    # DTensor's sharding propagation runs each op on fake tensors of the *global* shape, in the
    # caller's FakeTensorMode when there is one: under the tracker those unsharded temporaries
    # are counted (a 3x false optimizer-state spike, measured). A private fake mode keeps them
    # out of the count, as on real tensors.
    import torch.distributed.tensor._sharding_prop as sharding_prop

    original = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        sharding_prop.detect_fake_mode = original
