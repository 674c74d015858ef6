"""A small token model that fails on demand, the way a worker group must survive, and only
inside trial workers (torchrun sets LOCAL_RANK): the driver analyses and estimates it normally.

``fault`` (in the forward pass of the chosen rank, micro-batch size and step):
- ``none``: trains normally;
- ``hang``: sleeps ``seconds`` (a hang: the other ranks wait for it in their next collective);
- ``slow``: the same sleep, meant to be short: a trial that is busy, not hung;
- ``raise``: raises ``RuntimeError(message)``;
- ``kill``: the process kills itself with SIGKILL (as the OOM killer would);
- ``exit``: the process exits with code 3 (as a crash in native code would);
- ``sysexit``: ``sys.exit(3)`` (a model's own code ending the program);
- ``nan``: the logits become NaN from that step on (a diverging model: an fp16 overflow, a bad
  learning rate).
``rank=-1`` means every rank, ``batch=0`` every micro-batch size; ``step`` counts forward passes
of one trial from 1. Besides: ``spam`` bytes printed by every forward pass in workers; ``argv``:
the factory parses the command line with argparse in workers (which see the worker's own flags);
``noise``: the factory prints a line wherever it runs (the driver too); ``build_seconds``: the
factory sleeps that long in the driver only (a factory that hangs where autoshard analyses it).
The environment variable ``FAULTS_DISK_FULL=1`` makes every forward in workers raise the
``OSError`` of a full disk: a failure from outside the model, under the same target arguments.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import time

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(x))


class FaultyLM(nn.Module):
    def __init__(
        self,
        *,
        fault: str,
        rank: int,
        batch: int,
        step: int,
        seconds: float,
        message: str,
        spam: int,
        vocab: int,
        width: int,
        layers: int,
    ) -> None:
        super().__init__()
        self.fault, self.rank, self.batch, self.step = fault, rank, batch, step
        self.seconds, self.message, self.spam = seconds, message, spam
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)
        self.forwards = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.spam and "LOCAL_RANK" in os.environ:
            print(f"spam {self.forwards} " + "x" * self.spam, flush=True)
        if self._strikes(ids):
            self._fail()
        if os.environ.get("FAULTS_DISK_FULL") == "1" and "LOCAL_RANK" in os.environ:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/out/checkpoint.pt")
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        if self.fault == "nan" and self._diverged(ids):
            x = x * float("nan")
        return self.head(x)

    def _diverged(self, ids: torch.Tensor) -> bool:
        in_worker = "LOCAL_RANK" in os.environ
        this_rank = self.rank < 0 or os.environ.get("RANK") == str(self.rank)
        this_batch = self.batch <= 0 or ids.shape[0] == self.batch
        return in_worker and this_rank and this_batch and self.forwards >= self.step

    def _strikes(self, ids: torch.Tensor) -> bool:
        in_worker = "LOCAL_RANK" in os.environ
        this_rank = self.rank < 0 or os.environ.get("RANK") == str(self.rank)
        this_batch = self.batch <= 0 or ids.shape[0] == self.batch
        return in_worker and this_rank and this_batch and self.forwards == self.step

    def _fail(self) -> None:
        match self.fault:
            case "hang" | "slow":
                time.sleep(self.seconds)
            case "raise":
                raise RuntimeError(self.message)
            case "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            case "exit":
                os._exit(3)
            case "sysexit":
                sys.exit(3)
            case "none" | "nan":
                pass
            case _:
                raise ValueError(f"unknown fault {self.fault!r}")


def build(
    fault: str = "none",
    rank: int = -1,
    batch: int = 0,
    step: int = 1,
    seconds: float = 3600.0,
    message: str = "injected fault",
    spam: int = 0,
    argv: bool = False,
    noise: bool = False,
    build_seconds: float = 0.0,
    vocab: int = 256,
    width: int = 32,
    layers: int = 2,
) -> FaultyLM:
    if noise:
        print("building the faulty model")
    if build_seconds and "LOCAL_RANK" not in os.environ:
        time.sleep(build_seconds)
    if argv and "LOCAL_RANK" in os.environ:
        argparse.ArgumentParser(prog="train.py").parse_args()
    return FaultyLM(
        fault=fault,
        rank=rank,
        batch=batch,
        step=step,
        seconds=seconds,
        message=message,
        spam=spam,
        vocab=vocab,
        width=width,
        layers=layers,
    )
