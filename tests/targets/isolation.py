"""A model factory for the trial-isolation tests (tests/test_isolation.py), run inside trial
workers: it keeps a weak reference to every module and parameter it builds, by trial, and
refuses to build while one of an earlier trial is still alive in the process: the second trial
of a worker group then fails with what the first one left. ``leak=True`` keeps its model alive on
purpose once a trial trains it (a user's module-level cache would), for the group's defence: the
next trial restarts the group.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

_BUILT: list[tuple[int, weakref.ReferenceType[object]]] = []  # (trial, module or parameter)
_KEPT: list[nn.Module] = []  # models kept alive on purpose (leak=True)


def build(
    trial: int = 0, leak: bool = False, width: int = 64, meta_unsafe: bool = False
) -> tuple[nn.Module, torch.Tensor]:
    """``meta_unsafe``: reads a weight while building, which fails on meta (the worker then
    builds it on the CPU, and a large one it keeps from that build)."""
    earlier = [ref() for t, ref in _BUILT if t != trial and ref() is not None]
    # a model kept on purpose is the defence's business, not a holder of autoshard's
    kept = {id(o) for m in _KEPT for o in (*m.modules(), *m.parameters())}
    alive = [o for o in earlier if id(o) not in kept]
    if alive:
        params = [o for o in alive if isinstance(o, torch.Tensor)]
        raise RuntimeError(
            f"an earlier trial's model is alive: {len(alive) - len(params)} modules and "
            f"{len(params)} parameters ({sum(p.numel() * p.element_size() for p in params):,} "
            "bytes) before this trial builds"
        )
    model = Stack(*[nn.Linear(width, width) for _ in range(4)])
    model.leak = leak
    if meta_unsafe:
        float(model[0].weight.detach().norm())
    for obj in (*model.modules(), *model.parameters()):
        _BUILT.append((trial, weakref.ref(obj)))
    return model, torch.randn(4, width)


class Stack(nn.Sequential):
    """Linear layers in a row; with ``leak``, the first forward of it sharded (a trial's, not
    the unsharded warm-up's) keeps it alive in this module for good."""

    leak = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.leak and self not in _KEPT and any(map(_sharded, self.children())):
            _KEPT.append(self)
        return super().forward(x)


def _sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel | FSDPModule)
