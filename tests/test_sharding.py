"""FSDP1 kwargs are exactly what Lightning's FSDPStrategy builds for the same choices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoshard.config import Candidate
from autoshard.errors import ConfigError
from autoshard.sharding import fsdp1_kwargs, make_optimizer, resolve_classes

LINEAR = "torch.nn.modules.linear.Linear"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("offload", [False, True])
def test_fsdp1_kwargs_match_lightning(precision: str, sharding: str, offload: bool) -> None:
    pytest.importorskip("lightning")
    from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy

    c = Candidate(
        wrap_classes=(LINEAR,), precision=precision, sharding=sharding, cpu_offload=offload
    )
    ours = fsdp1_kwargs(c)
    strategy = FSDPStrategy(
        auto_wrap_policy={nn.Linear},
        sharding_strategy=sharding,
        cpu_offload=offload,
        limit_all_gathers=c.limit_all_gathers,
        forward_prefetch=c.forward_prefetch,
    )
    assert ours["sharding_strategy"] == strategy.sharding_strategy
    assert ours["cpu_offload"] == strategy.cpu_offload
    assert ours["use_orig_params"] is strategy.kwargs["use_orig_params"] is True
    assert ours["limit_all_gathers"] == strategy.kwargs["limit_all_gathers"]
    assert (
        ours["auto_wrap_policy"]._module_classes
        == strategy.kwargs["auto_wrap_policy"]._module_classes
    )
    lightning_mp = FSDPPrecision(precision).mixed_precision_config
    assert ours["mixed_precision"] == lightning_mp


def test_resolve_classes_names_the_problem() -> None:
    assert resolve_classes([LINEAR]) == {nn.Linear}
    with pytest.raises(ConfigError, match=r"cannot import class 'nope\.Block'"):
        resolve_classes(["nope.Block"])
    with pytest.raises(ConfigError, match=r"not an nn\.Module class"):
        resolve_classes(["torch.Tensor"])


@pytest.mark.parametrize(
    ("optimizer", "impl", "expected"),
    [("adamw", "foreach", torch.optim.AdamW), ("adam", "for_loop", torch.optim.Adam),
     ("sgd", "fused", torch.optim.SGD), ("adamw", "fused", torch.optim.AdamW)],
)  # fmt: skip
def test_make_optimizer(optimizer: str, impl: str, expected: type) -> None:
    model = nn.Linear(4, 4)
    opt = make_optimizer(model.parameters(), Candidate(optimizer=optimizer, optimizer_impl=impl))
    assert type(opt) is expected
    group = opt.param_groups[0]
    if impl == "fused":
        assert group["fused"] is True
    else:
        assert group["foreach"] is (impl == "foreach")


def test_wrap_classes_come_from_the_model_first_then_by_import_and_sgd_keeps_momentum() -> None:
    import torch
    from torch import nn

    from autoshard.config import Candidate
    from autoshard.sharding import make_optimizer, wrap_classes_of

    class LocalBlock(nn.Module):  # not importable by its path: found in the model itself
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

    model = nn.Sequential(LocalBlock(), nn.ReLU())
    local = f"{LocalBlock.__module__}.{LocalBlock.__qualname__}"
    assert wrap_classes_of(model, [local]) == {LocalBlock}
    # a class the model does not hold is imported by its path
    assert wrap_classes_of(model, [local, "torch.nn.modules.conv.Conv2d"]) == {
        LocalBlock,
        nn.Conv2d,
    }
    sgd = make_optimizer([nn.Parameter(torch.ones(2))], Candidate(optimizer="sgd"))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
