"""Building a model whose tensors hold no values (target/values_skipped.py): value-only writes
are skipped on meta and fake tensors, shapes still change, real tensors are written. Moved from
tests/test_target.py (now tests/target/test_resolve.py)."""

from __future__ import annotations

import torch
from torch import nn


def test_values_are_skipped_only_where_tensors_hold_none() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autoshard.target.values_skipped import values_skipped, writes_values_only

    aten = torch.ops.aten
    assert all(map(writes_values_only, [aten.normal_.default, aten.copy_.default])), "values"
    assert not any(
        map(writes_values_only, [aten.resize_.default, aten.t_.default, aten.add.out])
    ), "a new shape, or an out= argument that may be resized"
    with torch.device("meta"), values_skipped():
        real = torch.ones(3, device="cpu").mul_(2)  # a buffer made on the CPU on purpose
        turned = torch.empty(2, 3).t_()
        layer = nn.Linear(8, 4)
    assert real.tolist() == [2.0, 2.0, 2.0]
    assert turned.shape == (3, 2) and layer.weight.is_meta and layer.weight.shape == (4, 8)
    with FakeTensorMode(), values_skipped():
        fake = torch.empty(4, 4)
        assert fake.normal_() is fake
