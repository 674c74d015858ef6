"""The model the step-time tests work out by hand: blocks of one square bias-free Linear and a
ReLU, with an input and an output Linear around them where a test wants root-unit work."""

from __future__ import annotations

import torch
from torch import nn

from autoshard.analyze import analyze_model
from autoshard.config import WorkloadSpec
from autoshard.predict.flops import FlopProfile, profile_flops
from autoshard.results import ModelProfile

WRAP = ("tests.predict.linear_chain.Block",)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Chain(nn.Module):
    def __init__(self, width: int, blocks: int, *, inp: bool = True, head: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width, bias=False) if inp else None
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, width, bias=False) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x) if self.inp is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def profiled(
    chain: Chain, workload: WorkloadSpec | None = None
) -> tuple[ModelProfile, FlopProfile]:
    """The chain's profile and its FLOP profile at a batch of 2 rows (``chain`` built on meta)."""
    profile = analyze_model(chain)
    width = chain.blocks[0].fc.in_features
    flops = profile_flops(chain, profile, workload or WorkloadSpec(), batch=torch.randn(2, width))
    return profile, flops
