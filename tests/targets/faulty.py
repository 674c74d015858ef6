"""A model factory that misbehaves inside trial workers only (torchrun sets LOCAL_RANK), so the
driver can analyse it while the workers crash or hang on demand."""

from __future__ import annotations

import os
import time

from torch import nn


def build(mode: str = "ok", width: int = 64) -> nn.Module:
    in_worker = "LOCAL_RANK" in os.environ
    if in_worker and mode == "crash" and os.environ.get("RANK") == "1":
        os._exit(3)  # one rank dies abruptly, as a segfault or the OOM killer would do
    if in_worker and mode == "hang":
        time.sleep(3600)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def autoshard_loss(output, batch):  # the documented hook for a user's own loss
    return output.pow(2).mean()
