"""One optimizer step in the order of the user's training loop: the one step function that
trials (:mod:`autoshard.trials.worker`), the simulation (:mod:`autoshard.predict.simulate`) and
the measured benchmark run, so that what autoshard predicts, measures and recommends holds the
same memory as the user's run.

The order decides which tensors are alive together (:class:`autoshard.config.Loop`):

- ``LIGHTNING``, the Trainer's automatic optimization (lightning 2.6,
  ``lightning/pytorch/loops/optimization/automatic.py``, ``Closure.closure``): ``training_step``,
  then ``zero_grad`` (only on the first micro-batch of an accumulation window), then
  ``backward``; ``optimizer.step`` after the last micro-batch. The previous step's gradients are
  still allocated through the next forward. With ``accumulate_grad_batches > 1`` the Trainer
  skips the gradient sync of the other micro-batches (``_block_parallel_sync_behavior`` ->
  ``ParallelStrategy.block_backward_sync``), but only for a model with a ``no_sync`` method
  (its ``DistributedDataParallel`` protocol check): FSDP1's ``FullyShardedDataParallel.no_sync``
  (unsharded gradients kept across micro-batches) under ``FSDPStrategy``; FSDP2 modules have no
  ``no_sync``, so ``ModelParallelStrategy`` reduce-scatters every micro-batch into the sharded
  gradients.
- ``PLAIN``: forward, backward, and after the last micro-batch ``step`` then
  ``zero_grad(set_to_none=True)``. Accumulation follows the recipe of torch's FSDP docs,
  Fabric's ``no_backward_sync`` and accelerate's ``accumulate``: every micro-batch but the last
  skips the gradient sync (FSDP1 ``no_sync()``; FSDP2 ``set_requires_gradient_sync(False)``),
  which keeps unsharded gradients between micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autoshard.config import Candidate, Loop, WorkloadSpec
from autoshard.sharding import compute_dtype
from autoshard.target.step import LossFn, compute_loss, forward


def autocast_for(candidate: Candidate, device: torch.device) -> Any:
    """The autocast context of a step: FSDP's mixed precision casts the parameters; autocast
    also runs what is outside the wrapped units (the loss) in the compute dtype, as Lightning's
    precision plugin does."""
    if candidate.precision.mixed:
        return torch.autocast(device.type, dtype=compute_dtype(candidate.precision))
    return torch.autocast(device.type, enabled=False)


@contextlib.contextmanager
def gradient_sync_skipped(model: nn.Module, skip: bool) -> Iterator[None]:
    """Within the block, backward keeps unsharded gradients instead of reducing them (FSDP1
    ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``); nothing when ``skip`` is False."""
    if not skip:
        yield
        return
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _skips_sync(model: nn.Module, loop: Loop) -> bool:
    """Whether the loop skips the gradient sync of the micro-batches before the last."""
    if loop == Loop.PLAIN:
        return True
    from torch.distributed.fsdp import FullyShardedDataParallel

    # Lightning blocks the sync only for models with a ``no_sync`` method (see the docstring).
    return isinstance(model, FullyShardedDataParallel)


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    workload: WorkloadSpec,
    *,
    autocast: Any,
    loss_fn: LossFn | None = None,
    after_micro_batch: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One optimizer step of ``workload.accumulate`` micro-batches (each ``batch``) in the order
    of ``workload.loop``; returns the step's loss, detached (the mean over the micro-batches).

    ``autocast`` is a context manager, entered around each forward and loss (reusable:
    :func:`autocast_for`); ``after_micro_batch`` is called after each micro-batch's backward
    (torch's memory trackers must reset their per-module statistics before a module runs
    again)."""
    n = workload.accumulate
    skip = _skips_sync(model, workload.loop) and n > 1
    total = torch.zeros((), device=_device_of(model))
    for i in range(n):
        with gradient_sync_skipped(model, skip and i < n - 1):
            with autocast:
                loss = compute_loss(forward(model, batch), batch, loss_fn)
            if n > 1:
                loss = loss / n  # as the Trainer normalises (ClosureResult)
            if workload.loop == Loop.LIGHTNING and i == 0:
                # The Trainer's closure: training_step, then zero_grad, then backward. Its
                # LightningModule.optimizer_zero_grad calls zero_grad() (set_to_none=True).
                optimizer.zero_grad()
            loss.backward()
        total = total + loss.detach()
        del loss
        if after_micro_batch is not None and i < n - 1:
            after_micro_batch()
    optimizer.step()
    if workload.loop == Loop.PLAIN:
        optimizer.zero_grad(set_to_none=True)
    return total


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")
