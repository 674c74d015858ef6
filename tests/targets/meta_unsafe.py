"""A factory that cannot be built on the meta device: it reads a weight's value while building
(issue 25, case 2). ``CALLS`` records each call's device, how many layers it built there, and
how many warnings the test had recorded (in ``SEEN``) when it started."""

from __future__ import annotations

import torch
from torch import nn

CALLS: list[dict[str, object]] = []
SEEN: list[object] = []  # the test's recorded warnings


def build(layers: int = 30, width: int = 1024, read_at: str = "each") -> nn.Module:
    """``layers`` x Linear(width, width); reads a weight's norm after each layer (``each``) or
    once all are built (``end``), which fails on meta."""
    call: dict[str, object] = {"device": str(torch.empty(0).device), "warnings": len(SEEN)}
    CALLS.append(call)
    stack = nn.Sequential()
    for n in range(layers):
        stack.append(nn.Linear(width, width))
        call["layers"] = n + 1
        if read_at == "each":
            float(stack[-1].weight.detach().norm())
    if read_at == "end":
        float(stack[0].weight.detach().norm())
    return stack
