"""tests/targets/faulty.py's model with an example batch, importable as a package module."""

from __future__ import annotations

import torch
from torch import nn

from tests.targets.faulty import autoshard_loss
from tests.targets.faulty import build as build_model

__all__ = ["autoshard_loss", "build"]


def build(mode: str = "ok", width: int = 64) -> tuple[nn.Module, torch.Tensor]:
    return build_model(mode, width), torch.randn(4, width)
