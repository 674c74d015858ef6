"""A small token model whose forward fails the same way in every trial worker (torchrun sets
LOCAL_RANK), for what failures teach a study (issue 15, case 9); the driver analyses and
estimates it normally.

``fault``: ``none`` trains; ``raise`` raises ``KeyError('labels')`` in every configuration;
``hang`` sleeps an hour when the micro-batch is ``from_batch`` or more (a hang at one size).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(x))


class FailingLM(nn.Module):
    def __init__(self, fault: str, from_batch: int, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.fault, self.from_batch = fault, from_batch
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if "LOCAL_RANK" in os.environ:
            if self.fault == "raise":
                raise KeyError("labels")
            if self.fault == "hang" and ids.shape[0] >= self.from_batch:
                time.sleep(3600)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(
    fault: str = "none", from_batch: int = 4, vocab: int = 256, width: int = 32, layers: int = 2
) -> nn.Module:
    return FailingLM(fault, from_batch, vocab, width, layers)
