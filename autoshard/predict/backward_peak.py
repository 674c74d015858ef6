"""What one block's backward holds at its peak beyond what the block saved, measured by running
it: on fake tensors in the activation profile (:func:`autoshard.predict.activations.
profile_activations`), on real ones to check it (``benchmarks/block_backward_measured.py``).

A checkpointed block's backward first recomputes its forward (all of it, or under the op-level
policy what the policy did not keep), then turns what it saved into gradients as it goes: the
peak is somewhere inside, where the gradients made so far meet what is not freed yet. No rule
places it (half the block's saved activations was fitted at 64-128 tokens and over-counted a
Llama block at 512 tokens by 60%), so it is measured: every storage an operation makes is
followed until its last reference goes (:class:`LiveBytes`).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from autoshard.predict.fakes import tensors_in


class LiveBytes(TorchDispatchMode):
    """Every storage an operation makes while the mode is on, with its bytes, from when it is
    made to when its last reference goes (a weak reference's finalizer, as torch's
    ``MemTracker`` follows them): ``log`` is (storage key, +bytes made or -bytes freed) in
    order. Works on real and fake tensors alike; views and in-place results add nothing. A
    storage's key is its number in the order made (an address is reused once freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, int]] = {}  # address -> (key, bytes), while alive
        self.log: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: nothing is made
        given = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
        for t in tensors_in(out):
            if t.untyped_storage()._cdata not in given:
                self._follow(t.untyped_storage())
        return out

    def keys(self, tensors: Iterable[torch.Tensor]) -> frozenset[int]:
        """The keys of ``tensors``' storages that were made under the mode."""
        made = (self.live.get(t.untyped_storage()._cdata) for t in tensors)
        return frozenset(m[0] for m in made if m is not None)

    def _follow(self, storage: Any) -> None:
        address = storage._cdata
        if address in self.live:
            return
        key, nbytes = len(self.log), storage.nbytes()
        self.live[address] = key, nbytes
        self.log.append((key, nbytes))
        weakref.finalize(storage, self._freed, address)

    def _freed(self, address: int) -> None:
        key, nbytes = self.live.pop(address, (0, 0))
        if nbytes:
            self.log.append((key, -nbytes))

    def peak(self, start: int, ignore: frozenset[int] = frozenset()) -> int:
        """The most bytes made and not yet freed at once from ``log[start]`` on (0 when it only
        frees), leaving out the storages in ``ignore``."""
        live = top = 0
        for key, nbytes in self.log[start:]:
            if key not in ignore:
                live += nbytes
                top = max(top, live)
        return top


@dataclass(frozen=True)
class BackwardPeak:
    """One block's backward, per call: the most bytes it holds at once beyond what the block
    saved (its input where it is checkpointed), from the gradient arriving from above to the
    gradient it passes below; ``activations_only`` leaves out its parameters' gradients, which
    FSDP2 holds in the unit's unsharded gradients (counted as the unit's reduce buffers)."""

    total: int
    activations_only: int


def block_backward_peak(
    block: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    context_fn: Callable[[], Any] | None = None,
) -> BackwardPeak:
    """Run ``block`` on ``args`` and ``kwargs`` (its first tensor argument is the activation;
    the other tensors are taken as constants) under non-reentrant activation checkpointing
    (with ``context_fn``: op-level, :func:`autoshard.sharding.selective_context`), then its
    backward from a gradient of its output's shape, and measure the backward's peak
    (:class:`BackwardPeak`). Run it inside the precision's autocast, on the tensors' device or
    fake mode.

    >>> import torch
    >>> from torch import nn
    >>> block = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    >>> peak = block_backward_peak(block, (torch.randn(8, 64),), {})
    >>> peak.activations_only >= 8 * 256 * 4  # the recomputed hidden layer at least
    True
    >>> peak.total - peak.activations_only <= sum(p.numel() * 4 for p in block.parameters())
    True
    """
    from torch.utils.checkpoint import checkpoint

    first = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))

    def constant(value: Any) -> Any:
        return value.detach() if isinstance(value, torch.Tensor) else value

    args, kwargs = tree_map(constant, (args, kwargs))
    x = args[first].requires_grad_()
    args = (*args[:first], x, *args[first + 1 :])
    params = [p for p in block.parameters() if p.requires_grad]
    extra: dict[str, Any] = {"context_fn": context_fn} if context_fn is not None else {}
    live = LiveBytes()
    with live:
        out = checkpoint(block, *args, use_reentrant=False, **extra, **kwargs)
        out = next(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        # the output is the next block's input: freed before this block's backward in a step
        held = live.keys([out])
        start = len(live.log)
        grads = torch.autograd.grad(out, [x, *params], torch.ones_like(out), allow_unused=True)
        param_grads = live.keys(g for g in grads[1:] if g is not None)
        del grads, out
    return BackwardPeak(
        total=live.peak(start, held), activations_only=live.peak(start, held | param_grads)
    )


@contextlib.contextmanager
def first_calls(blocks: list[nn.Module]) -> Iterator[dict[int, tuple[Any, dict[str, Any]]]]:
    """Through a forward, each block's first call: block index -> (args, kwargs)."""
    calls: dict[int, tuple[Any, dict[str, Any]]] = {}
    handles = []
    for index, block in enumerate(blocks):

        def pre(_m: nn.Module, args: Any, kwargs: Any, index: int = index) -> None:
            calls.setdefault(index, (args, dict(kwargs)))

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


# A Hugging Face block's key/value cache: checkpointing runs without it
# (sharding._without_kv_cache). Its argument's name changes between releases ("cache" from
# transformers 5.24), so a cache object is also known by its class.
_CACHE_KWARGS = ("past_key_value", "past_key_values", "layer_past", "cache")


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A block's keyword arguments with its key/value cache taken out and turned off.

    >>> without_cache({"past_key_values": object(), "use_cache": True, "mask": 1})
    {'past_key_values': None, 'use_cache': False, 'mask': 1}
    """
    kwargs = {k: None if k in _CACHE_KWARGS or _is_cache(v) else v for k, v in kwargs.items()}
    return kwargs | ({"use_cache": False} if "use_cache" in kwargs else {})


def _is_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face cache object (``transformers.cache_utils.Cache``): it
    holds the profile's keys and values, made in a forward whose graph is gone."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache = getattr(cache_utils, "Cache", None)
    return cache is not None and isinstance(value, cache)


def checkpointed_backward_peaks(
    blocks: list[nn.Module], calls: dict[int, tuple[Any, dict[str, Any]]], saved: Sequence[int]
) -> tuple[BackwardPeak, BackwardPeak] | None:
    """The backward peaks (whole-block checkpointing, op-level) of the block that ``saved`` the
    most in a profile's forward among those it ran with their own parameters (a repeat left on
    meta reused a count), called as in its first call (``calls``, :func:`first_calls`); None
    where none was. The profile wraps a block's forward to count it (``__wrapped__``: the
    block's own), which is set aside meanwhile."""
    from autoshard.sharding import selective_context

    runnable = [i for i in calls if not any(p.is_meta for p in blocks[i].parameters())]
    if not runnable:
        return None
    index = max(runnable, key=lambda i: saved[i])
    block, (args, kwargs) = blocks[index], calls[index]
    # GPT-2's model passes its cache positionally (GPT2Block(hidden_states, cache, mask, ...))
    args, kwargs = tuple(None if _is_cache(a) else a for a in args), without_cache(kwargs)
    counting = block.__dict__.get("forward")
    if counting is not None and hasattr(counting, "__wrapped__"):
        block.forward = counting.__wrapped__
    try:
        whole = block_backward_peak(block, args, kwargs)
        selective = block_backward_peak(block, args, kwargs, context_fn=selective_context)
    finally:
        if counting is not None:
            block.forward = counting
    return whole, selective
