"""A candidate applied to a model as every trial applies it (autoshard.sharding), in the test
process: a single-rank gloo process group, so that FSDP1 and FSDP2 really wrap, shard, cast and
checkpoint, in seconds and without starting processes. What each rank of a real trial gets is
the same code (the multi-process tests in the slow tier run it across ranks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from autoshard.config import Candidate
from autoshard.sharding import (
    apply_candidate,
    cpu_workers_cannot_run,
    float8_linears,
    fsdp2_kwargs,
    mesh_for,
    rank_device,
)

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class Stack(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


BLOCK = f"{Block.__module__}.{Block.__qualname__}"


def candidate(**update: object) -> Candidate:
    base = {"wrap_classes": (BLOCK,), "precision": "bf16-mixed"}
    return Candidate.model_validate(base | update)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    if dist.is_initialized():  # pragma: no cover - another test left one: use it
        yield
        return
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _checkpointed(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "CheckpointWrapper"]


def test_fsdp1_wraps_each_block_checkpoints_every_kth_and_casts(one_rank) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    every2 = candidate(checkpointing="every_k", checkpoint_every=2, checkpoint_classes=(BLOCK,))
    model = apply_candidate(Stack(), every2, CPU)
    assert isinstance(model, FSDP)
    units = [m for m in FSDP.fsdp_modules(model) if m is not model]
    assert len(units) == 4 and all(isinstance(u.module, Block) for u in units)
    assert _checkpointed(model) == [
        "_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module",
        "_fsdp_wrapped_module.blocks.2._fsdp_wrapped_module",
    ]
    assert model.mixed_precision.param_dtype is torch.bfloat16
    out = model(torch.randn(2, 16))
    assert out.dtype is torch.bfloat16  # it computes in the candidate's precision
    out.float().sum().backward()
    # no wrap classes: the whole model one unit; bf16-true: the model itself cast first
    whole = apply_candidate(Stack(), Candidate(precision="bf16-true"), CPU)
    assert FSDP.fsdp_modules(whole) == [whole]
    assert {p.dtype for p in whole.parameters()} == {torch.bfloat16}
    assert _checkpointed(whole) == []


def _kept_after_forward(model: nn.Module) -> dict[str, bool]:
    """Per FSDP2 unit: whether its parameters stay gathered after forward."""
    from torch.distributed.fsdp import FSDPModule

    kept = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            kept[name.replace("._checkpoint_wrapped_module", "")] = (
                group.post_forward_mesh_info is None
            )
    return kept


def test_fsdp2_shards_each_block_then_the_root_with_the_reshard_policy(one_rank) -> None:
    c = candidate(engine="fsdp2", reshard="keep_root_and_last", checkpointing="every_k",
                  checkpoint_every=2, checkpoint_classes=(BLOCK,))  # fmt: skip
    model = apply_candidate(Stack(), c, CPU)
    assert _kept_after_forward(model) == {
        "": True, "blocks.0": False, "blocks.1": False, "blocks.2": False, "blocks.3": True,
    }  # fmt: skip
    assert _checkpointed(model) == ["blocks.0", "blocks.2"]
    root = model._get_fsdp_state()._fsdp_param_group
    assert root.mp_policy.param_dtype is torch.bfloat16
    assert root.mp_policy.reduce_dtype is torch.float32  # gradients reduced in fp32
    out = model(torch.randn(2, 16))
    assert out.dtype is torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # ALL (the default) reshards every unit, the root too; KEEP_ROOT keeps the root only;
    # SHARD_GRAD_OP keeps them all; fp32 has no mixed precision policy
    every = _kept_after_forward(apply_candidate(Stack(), candidate(engine="fsdp2"), CPU))
    assert every == {"": False, **{f"blocks.{i}": False for i in range(4)}}
    root = _kept_after_forward(
        apply_candidate(Stack(), candidate(engine="fsdp2", reshard="keep_root"), CPU)
    )
    assert root == {"": True, **{f"blocks.{i}": False for i in range(4)}}
    kept = apply_candidate(Stack(), candidate(engine="fsdp2", sharding="SHARD_GRAD_OP"), CPU)
    assert set(_kept_after_forward(kept).values()) == {True}
    fp32 = apply_candidate(Stack(), candidate(engine="fsdp2", precision="32-true"), CPU)
    assert fp32._get_fsdp_state()._fsdp_param_group.mp_policy.param_dtype is None


def test_mesh_fores_and_unit_arguments(one_rank) -> None:
    flat = mesh_for(candidate(engine="fsdp2"), CPU, 1)
    assert flat.mesh_dim_names == ("shard",) and tuple(flat.shape) == (1,)
    replicated = mesh_for(candidate(engine="fsdp2", sharding="NO_SHARD"), CPU, 1)
    assert replicated.mesh_dim_names == ("replicate", "shard") and tuple(replicated.shape) == (1, 1)
    hybrid = candidate(engine="fsdp2", sharding="HYBRID_SHARD", hybrid_mesh=(1, 1))
    mesh = mesh_for(hybrid, CPU, 1)
    assert mesh.mesh_dim_names == ("replicate", "shard") and tuple(mesh.shape) == (1, 1)
    kwargs = fsdp2_kwargs(candidate(engine="fsdp2", cpu_offload=True), flat, pin_memory=False)
    assert kwargs["mesh"] is flat and kwargs["reshard_after_forward"] is True
    assert kwargs["offload_policy"].pin_memory is False
    assert kwargs["mp_policy"].param_dtype is torch.bfloat16
    no_mp = fsdp2_kwargs(candidate(engine="fsdp2", precision="32-true"), flat, pin_memory=True)
    assert "mp_policy" not in no_mp and "offload_policy" not in no_mp
    assert rank_device() == CPU  # no GPU here: ranks train on the CPU


def test_what_cpu_workers_cannot_run_word_for_word(monkeypatch) -> None:
    import autoshard.sharding as sharding

    assert cpu_workers_cannot_run(candidate(cpu_offload=True)) == (
        "FSDP1's CPU offload needs a GPU: CPU workers cannot try it (torch cannot run it on "
        "CPU processes); its memory is the estimate's"
    )
    assert cpu_workers_cannot_run(candidate(engine="fsdp2", cpu_offload=True)) is None
    assert cpu_workers_cannot_run(candidate(engine="fsdp2", float8=True)) == (
        "float8 needs fp8 tensor cores: CPU workers have none (a CPU trial would time an "
        "emulation); its speed and memory are the estimate's"
    )
    monkeypatch.setattr(sharding, "cpu_compiler_missing", lambda: "no compiler")
    assert cpu_workers_cannot_run(candidate(compile=True)) == (
        "no compiler; its speed and memory are the estimate's"
    )
    monkeypatch.setattr(sharding, "cpu_compiler_missing", lambda: None)
    assert cpu_workers_cannot_run(candidate(compile=True)) is None


def test_float8_converts_the_blocks_linears_of_sixteen_multiples_only() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fits = nn.Linear(32, 16)
            self.odd = nn.Linear(32, 10)  # not a multiple of 16: torch._scaled_mm refuses it

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.blocks = nn.ModuleList([Odd(), Odd()])
            self.head = nn.Linear(32, 64)
            self.tied = nn.Linear(32, 64)
            self.tied.weight = self.head.weight

    model = Model()
    path = f"{Odd.__module__}.{Odd.__qualname__}"
    chosen = float8_linears(model, candidate(engine="fsdp2", wrap_classes=(path,)))
    assert chosen == [model.blocks[0].fits, model.blocks[1].fits]
    # one unit: every eligible linear of the model, but never a tied weight (cast twice)
    whole = float8_linears(model, candidate(engine="fsdp2", wrap_classes=()))
    assert whole == [model.blocks[0].fits, model.blocks[1].fits]
    model.tied = nn.Linear(32, 64)
    assert float8_linears(model, Candidate(engine="fsdp2")) == [
        model.blocks[0].fits, model.blocks[1].fits, model.head, model.tied]  # fmt: skip


def test_a_rank_trains_on_its_local_gpu_unless_its_group_speaks_gloo(one_rank, monkeypatch):
    # the decision only (which device a rank picks): CUDA's presence is what is stood in for
    initialised = dist.is_initialized
    assert rank_device() == CPU  # no GPU here
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # before init_process_group
    assert rank_device() == torch.device("cuda", 3) and chosen == [3]  # made the current one
    monkeypatch.setattr(dist, "is_initialized", initialised)
    assert rank_device() == CPU  # a gloo group: CPU tensors
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    assert rank_device() == torch.device("cuda", 3)


def test_fsdp1_wraps_a_class_only_the_model_has_and_materialises_a_meta_model(one_rank) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    class LocalBlock(Block):  # not importable by its path: found in the model itself
        pass

    model = Stack()
    model.blocks = nn.ModuleList(LocalBlock() for _ in range(4))
    local = candidate(wrap_classes=(f"{__name__}.{LocalBlock.__qualname__}",))
    wrapped = apply_candidate(model, local, CPU)
    assert sum(isinstance(m, FSDP) for m in wrapped.modules()) == 5
    # built on meta: param_init_fn gives each module its values, as the trials build
    with torch.device("meta"):
        meta = Stack()
    filled: list[str] = []

    def init(module: nn.Module) -> None:
        module.to_empty(device=CPU, recurse=False)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)
        filled.append(type(module).__name__)

    wrapped = apply_candidate(meta, candidate(), CPU, param_init_fn=init)
    assert "Linear" in filled and not any(p.is_meta for p in wrapped.parameters())
    assert {float(p.detach().float().mean()) for p in wrapped.parameters()} == {0.5}


def test_fsdp2_no_shard_is_applied_on_its_2d_mesh(one_rank) -> None:
    model = apply_candidate(Stack(), candidate(engine="fsdp2", sharding="NO_SHARD"), CPU)
    mesh = model._get_fsdp_state()._fsdp_param_group.mesh_info.mesh
    assert mesh.mesh_dim_names == ("replicate", "shard")


def test_float8_converts_exactly_the_chosen_linears_or_names_what_to_install(monkeypatch) -> None:
    import sys

    from autoshard.errors import MissingDependencyError
    from autoshard.sharding import apply_float8

    pytest.importorskip("torchao.float8")
    model = Stack(width=32)
    apply_float8(model, candidate(engine="fsdp2", float8=True))
    converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert converted == [f"blocks.{i}.inner" for i in range(4)]  # the head stays bf16
    untouched = Stack(width=32)
    apply_float8(untouched, candidate(engine="fsdp2"))
    assert not any(type(m).__name__ == "Float8Linear" for m in untouched.modules())
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(MissingDependencyError) as missing:
        apply_float8(Stack(width=32), candidate(engine="fsdp2", float8=True))
    assert str(missing.value) == (
        "float8 training needs torchao, which is not installed: run "
        "`pip install 'autoshard[float8]'`"
    )


@pytest.mark.parametrize(("optimizer", "impl"), [("adam", "foreach"), ("sgd", "fused"),
                                                 ("sgd", "for_loop"), ("adamw", "foreach")])  # fmt: skip
def test_every_optimizer_takes_the_learning_rate(optimizer: str, impl: str) -> None:
    from autoshard.sharding import make_optimizer

    c = Candidate(optimizer=optimizer, optimizer_impl=impl)
    assert make_optimizer(nn.Linear(2, 2).parameters(), c).param_groups[0]["lr"] == 1e-4
    assert make_optimizer(nn.Linear(2, 2).parameters(), c, lr=0.5).param_groups[0]["lr"] == 0.5
