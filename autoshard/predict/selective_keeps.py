"""What op-level selective checkpointing keeps of each block's forward, counted on the activation
profile's fake forward (:mod:`autoshard.predict.activations`): the outputs of the operations
:func:`~autoshard.sharding.selective_policy` saves, and of those what the block's recompute in
backward does not add."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from autoshard.sharding import selective_policy


class SelectiveKeeps(TorchDispatchMode):
    """What selective checkpointing would keep of each block's forward: the outputs of the
    operations :func:`~autoshard.sharding.selective_policy` saves, one fresh policy per block
    call (as ``context_fn`` makes one per checkpointed call), counted once per storage; and of
    those, what the block's recompute in backward does not add (:meth:`saving`)."""

    def __init__(self, stack: list[int], blocks: int) -> None:
        super().__init__()
        self.stack = stack
        self.kept = [0] * blocks  # bytes kept, per block
        # of those, what the recompute does not rebuild: every kept output it replays (below)
        self.overlap = [0] * blocks
        self.storages: set[int] = set()
        # kept outputs the recompute has not replayed yet (in :meth:`saving`): (block, bytes)
        self.unreplayed: list[tuple[int, int]] = []
        # kept alive until the profile ends: a freed storage's address, reused by a later
        # output, would read as already counted
        self.held: list[Any] = []
        self.policy = selective_policy()
        self.ctx = SelectiveCheckpointContext(is_recompute=False)

    def enter(self) -> None:
        self.policy = selective_policy()
        self.unreplayed = []  # the previous block's: never replayed (its last save was before)

    def saving(self) -> None:
        """Autograd saves a tensor (any, a parameter or one already saved included): the
        block's recompute runs up to its forward's last save (torch's early stop) and replays
        every kept output made before it from the cache, which lets it go. One autograd saves
        too is held by what it was saved for; one it does not is freed once used (a projection
        before a residual add: 0.25 MiB per block of the fp32 GPT at 512 tokens, simulated).
        Either way the recompute does not add it: only kept outputs made after the block's last
        save stay in the cache beside what the recompute rebuilds."""
        if not self.stack or not self.unreplayed:
            return
        block = self.stack[-1]
        for owner, nbytes in self.unreplayed:
            if owner == block:
                self.overlap[owner] += nbytes
        self.unreplayed = [(o, n) for o, n in self.unreplayed if o != block]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.stack:
            return out
        decision = self.policy(self.ctx, func, *args, **kwargs)
        if decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.storages:
                    self.storages.add(t.untyped_storage()._cdata)
                    self.held.append(t.untyped_storage())
                    nbytes = t.untyped_storage().nbytes()
                    self.kept[self.stack[-1]] += nbytes
                    self.unreplayed.append((self.stack[-1], nbytes))
        return out
