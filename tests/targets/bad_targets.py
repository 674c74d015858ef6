"""Factories that fail in every way a user's factory can, for the bad-target tests."""

from __future__ import annotations

import torch
from torch import nn

NOT_CALLABLE = 42


def raises() -> nn.Module:
    raise ValueError("boom: n_layer must be positive")


def returns_int() -> int:
    return 3


def no_params() -> nn.Module:
    return nn.Sequential(nn.ReLU(), nn.Dropout())


def needs_values() -> nn.Module:
    """Reads a tensor value while building: impossible on the meta device."""
    scale = torch.ones(1)
    width = int(scale.item()) * 8
    return nn.Linear(width, width)


def with_batch(n: int = 4) -> tuple[nn.Module, torch.Tensor]:
    return nn.Linear(n, n), torch.zeros(2, n)


def needs_width(width, depth=2):
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
