"""emit/runtime: the optimizer a recommendation hands out is the one its trials built."""

from __future__ import annotations

import torch
from torch import nn

from tests.test_emit import candidate, make_rec


def test_the_optimizer_is_the_one_the_trials_built() -> None:
    model = nn.Linear(4, 4)
    sgd = make_rec(candidate(optimizer="sgd")).optimizer(model.parameters(), lr=0.5)
    assert type(sgd) is torch.optim.SGD
    group = sgd.param_groups[0]
    assert (group["lr"], group["momentum"], group["foreach"]) == (0.5, 0.9, True)
    fused = make_rec(candidate(optimizer_impl="fused")).optimizer(model.parameters(), lr=1e-3)
    assert type(fused) is torch.optim.AdamW and fused.param_groups[0]["fused"] is True
    adafactor = make_rec(candidate(optimizer="adafactor")).optimizer(model.parameters(), lr=1e-2)
    assert type(adafactor) is torch.optim.Adafactor
