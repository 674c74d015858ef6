"""A digest of what a model's forward computes: every operator it dispatches, in order, and each
call of a block, taken on the fake forward that the activation profile runs anyway
(:func:`autoshard.predict.activations.profile_activations`), so it costs one hash update per
operator.

A study's name includes it (:class:`autoshard.study.settings.StudySettings`): a forward edited
between two runs (``x = block(block(x))`` for ``x = block(x)``, a new operation) measures
something else, and starts a new study, even where the parameters are the same.
"""

from __future__ import annotations

import hashlib
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class ForwardDigest(TorchDispatchMode):
    """Records the forward's operators while active, and the block calls :meth:`call` is told
    of (a repeated block whose count the profile reuses is a call it does not run again).

    >>> import torch
    >>> def digest(fn):
    ...     with ForwardDigest() as d:
    ...         fn(torch.ones(2))
    ...     return d.hexdigest()
    >>> digest(lambda x: x * 2) == digest(lambda x: x * 3), digest(lambda x: x * 2 + 1)[:0]
    (True, '')
    >>> digest(lambda x: x * 2) == digest(lambda x: (x * 2) * 2)
    False
    """

    def __init__(self) -> None:
        super().__init__()
        self._hash = hashlib.sha256()

    def call(self, block: int) -> None:
        self._hash.update(f"block {block}\n".encode())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self._hash.update(f"{func}\n".encode())
        return func(*args, **(kwargs or {}))

    def hexdigest(self) -> str:
        return self._hash.hexdigest()[:16]
