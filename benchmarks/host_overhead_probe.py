"""Measure the host (CPU) seconds an eager training step spends issuing work, on this machine.

The step-time model's host-bound floor (``autoshard.predict.host_bound``) takes its constants
from runs of this script (``benchmarks/results/host_overhead_probe.txt``). Everything runs on
one CPU thread with tiny tensors (width 16), so the kernels' own arithmetic is a microsecond or
two and what is timed is what the host does for each operation and each FSDP unit:

- **per kernel**: one forward and backward of Lightning's demo Transformer (64 blocks) and of
  ``examples/gpt.py``'s Llama-style decoder (32 blocks) at 35 tokens, over the kernels the FLOP
  profile counts (:mod:`autoshard.predict.flop_counting`): Python, modules, the dispatcher and
  autograd, per counted operation;
- **per FSDP unit**: the same decoder (16 blocks, each its own unit) on 2 gloo ranks under FSDP1
  (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD) and FSDP2 (``fully_shard``, resharding after forward or
  not), minus the same step without FSDP: FSDP's hooks, parameter views, the collectives' calls
  and their copies of 16-wide tensors, per unit and step;
- **CPU AdamW**: one step of ``torch.optim.AdamW`` over 64 Mi fp32 parameters (for-loop,
  foreach), as bytes of the fused kernel's 7 passes per second: CPU offload's optimizer step;
- **per FSDP unit on one rank** (``units-one-rank``, issue 33: autoshard wraps one GPU in FSDP
  too), and FSDP2's float8 all-gather hooks per weight and all-gather;
- **per checkpointed block and per float8 layer** (``checkpoint-float8``): the same decoder
  under bf16 autocast, each block checkpointed as autoshard applies it (full, op-level
  selective), or its linear layers converted to torchao's ``Float8Linear``.

CPU seconds of the calling process (``time.process_time``), the median of 20 steps after 5 (for
the FSDP cases the least of three such medians: other jobs only add).

    python benchmarks/host_overhead_probe.py [kernels units units-one-rank checkpoint-float8 adamw]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIDTH = 16  # tiny tensors: the host's work, not the kernels'
SEQ = 35


def _median_step(step: Callable[[], None], repeats: int = 25, warmup: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times[warmup:])


def _gpt(blocks: int) -> nn.Module:
    from examples.gpt import GPT

    return GPT(
        n_layer=blocks, n_head=2, n_kv_head=2, d_model=WIDTH, ffn_hidden=2 * WIDTH,
        vocab_size=64, mlp="swiglu", max_seq_len=64,
    )  # fmt: skip


def _demo(blocks: int) -> nn.Module:
    from examples.lightning_transformer import build

    return build(vocab_size=64, nlayers=blocks // 2, nhid=WIDTH, ninp=WIDTH, nhead=2)[0]


def _counted_kernels(make: Callable[[], nn.Module], batch: object) -> int:
    """Kernels of one forward and backward as the FLOP profile counts them (fake tensors)."""
    from autoshard.analyze import analyze_model
    from autoshard.config import WorkloadSpec
    from autoshard.predict.flops import profile_flops

    with torch.device("meta"):
        meta = make()
    profile = analyze_model(meta)
    flops = profile_flops(meta, profile, WorkloadSpec(seq_len=SEQ), batch)
    assert flops.measured, flops.note
    return (
        sum(flops.block_forward_ops) + sum(flops.block_backward_ops)
        + flops.other_forward_ops + flops.other_backward_ops
    )  # fmt: skip


def per_kernel() -> None:
    torch.set_num_threads(1)
    tokens = torch.randint(0, 64, (1, SEQ + 1))
    demo_batch = (tokens[:, :-1], tokens[:, 1:])
    cases = {
        "demo Transformer, 64 blocks": (
            lambda: _demo(64),
            demo_batch,
            lambda m: nn.functional.nll_loss(m(*demo_batch).view(-1, 64), tokens[:, 1:].flatten()),
        ),
        "Llama-style decoder, 32 blocks": (
            lambda: _gpt(32),
            None,
            lambda m: m(tokens[:, :-1]).float().mean(),
        ),
    }
    for name, (make, batch, loss) in cases.items():
        model = make()

        def step(model: nn.Module = model, loss: Callable = loss) -> None:
            loss(model).backward()
            model.zero_grad(set_to_none=True)

        seconds = _median_step(step)
        kernels = _counted_kernels(make, batch)
        print(
            f"eager forward+backward, {name}: {seconds * 1e3:.1f} CPU ms, {kernels} counted "
            f"kernels, {seconds / kernels * 1e6:.1f} us per kernel"
        )


def _unit_costs(rank: int, world: int, port: int) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from examples.gpt import Block

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    blocks = 16
    x = torch.randint(0, 64, (1, SEQ))

    def timed(model: nn.Module) -> float:
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)

        def step() -> None:
            model(x).float().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        # the least of 3 medians: other jobs only add (gloo's waits spin on a busy machine)
        seconds = torch.tensor([min(_median_step(step) for _ in range(3))])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return seconds.item()

    torch.manual_seed(0)
    plain = timed(_gpt(blocks))

    def fsdp1(sharding: str) -> nn.Module:
        torch.manual_seed(0)
        return FullyShardedDataParallel(
            _gpt(blocks),
            sharding_strategy=ShardingStrategy[sharding],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"),
            use_orig_params=True,
        )

    def fsdp2(reshard: bool) -> nn.Module:
        torch.manual_seed(0)
        model = _gpt(blocks)
        for block in model.modules():
            if isinstance(block, Block):
                fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        return model

    cases = {
        "FSDP1 FULL_SHARD": lambda: fsdp1("FULL_SHARD"),
        "FSDP1 SHARD_GRAD_OP": lambda: fsdp1("SHARD_GRAD_OP"),
        "FSDP1 NO_SHARD": lambda: fsdp1("NO_SHARD"),
        "FSDP2 reshard_after_forward=True": lambda: fsdp2(True),
        "FSDP2 reshard_after_forward=False": lambda: fsdp2(False),
    }
    measured = {}
    for name, make in cases.items():
        seconds = measured[name] = timed(make())
        if rank == 0:
            per_unit = (seconds - plain) / (blocks + 1)  # the blocks and the root
            print(
                f"{name}, {world} ranks, {blocks} blocks: {seconds * 1e3:.1f} CPU ms per step "
                f"(without FSDP {plain * 1e3:.1f}): {per_unit * 1e3:.2f} ms per unit"
            )
    if world == 1:
        _float8_gathers(blocks, timed, measured["FSDP2 reshard_after_forward=True"] - plain)
    dist.barrier()
    dist.destroy_process_group()


def _float8_gathers(blocks: int, timed: Callable[[nn.Module], float], fsdp_s: float) -> None:
    """FSDP2's float8 all-gather on one rank: what its hooks add per converted weight and
    all-gather (each weight cast before its gather, wrapped after it, gathered again in
    backward), beyond FSDP2's own cost (``fsdp_s``) and the float8 layers' own."""
    from autoshard.config import Candidate
    from autoshard.sharding import apply_float8, float8_linears
    from examples.gpt import Block

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    candidate = Candidate(engine="fsdp2", wrap_classes=("examples.gpt.Block",), float8=True)

    def float8_model(shard: bool) -> nn.Module:
        torch.manual_seed(0)
        model = _gpt(blocks)
        apply_float8(model, candidate)
        if shard:
            for block in model.modules():
                if isinstance(block, Block):
                    fully_shard(block)
            fully_shard(model)
        return model

    layers = len(float8_linears(_gpt(blocks), candidate))
    alone, sharded = timed(float8_model(False)), timed(float8_model(True))
    gathers = 2 * layers  # each weight gathered in forward and again in backward
    hooks = (sharded - alone - fsdp_s) / gathers
    print(
        f"FSDP2 float8 all-gather, 1 rank, {layers} float8 layers: {sharded * 1e3:.1f} CPU ms "
        f"(float8 without FSDP {alone * 1e3:.1f}, FSDP2's own {fsdp_s * 1e3:.1f}): "
        f"{hooks * 1e3:.3f} ms per weight and all-gather"
    )


def _counted(make: Callable[[], nn.Module]) -> tuple[int, int]:
    """(forward kernels of one block, kernels of one forward and backward) as the FLOP profile
    counts them."""
    from autoshard.analyze import analyze_model
    from autoshard.config import WorkloadSpec
    from autoshard.predict.flops import profile_flops

    with torch.device("meta"):
        meta = make()
    profile = analyze_model(meta)
    flops = profile_flops(meta, profile, WorkloadSpec(seq_len=SEQ))
    total = sum(flops.block_forward_ops) + sum(flops.block_backward_ops)
    return flops.block_forward_ops[0], total + flops.other_forward_ops + flops.other_backward_ops


def checkpoint_and_float8() -> None:
    """Per checkpointed block (non-reentrant, as autoshard applies it: full, and op-level
    selective), beyond its recomputed kernels; and per float8 linear layer (torchao's
    Float8Linear, eager): the host seconds of one forward and backward under bf16 autocast, on
    the 16-block decoder, as :func:`autoshard.sharding.apply_checkpointing` and
    :func:`autoshard.sharding.apply_float8` set them up."""
    from autoshard.config import Candidate
    from autoshard.sharding import apply_checkpointing, apply_float8, float8_linears

    torch.set_num_threads(1)
    blocks = 16
    x = torch.randint(0, 64, (1, SEQ))
    fwd_block, kernels = _counted(lambda: _gpt(blocks))

    def timed(model: nn.Module) -> float:
        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().mean()
            loss.backward()
            model.zero_grad(set_to_none=True)

        return min(_median_step(step) for _ in range(3))

    torch.manual_seed(0)
    plain = timed(_gpt(blocks))
    per_kernel = plain / kernels
    print(
        f"bf16 autocast forward+backward, {blocks} blocks: {plain * 1e3:.1f} CPU ms, {kernels} "
        f"counted kernels, {per_kernel * 1e6:.1f} us per kernel"
    )
    wrap = ("examples.gpt.Block",)
    for how in ("all", "selective"):
        torch.manual_seed(0)
        model = _gpt(blocks)
        apply_checkpointing(model, Candidate(checkpointing=how, checkpoint_classes=wrap))
        seconds = timed(model)
        extra = (seconds - plain) / blocks - fwd_block * per_kernel  # beyond the recompute
        print(
            f"checkpointing {how}, {blocks} blocks: {seconds * 1e3:.1f} CPU ms: "
            f"{extra * 1e3:.2f} ms per block beyond its {fwd_block} recomputed kernels, "
            f"{extra / fwd_block * 1e6:.0f} us per forward kernel"
        )
    torch.manual_seed(0)
    model = _gpt(blocks)
    candidate = Candidate(engine="fsdp2", wrap_classes=wrap, float8=True)
    linears = len(float8_linears(model, candidate))
    apply_float8(model, candidate)
    seconds = timed(model)
    print(
        f"float8 (torchao Float8Linear, eager), {linears} converted linear layers: "
        f"{seconds * 1e3:.1f} CPU ms: {(seconds - plain) / linears * 1e3:.2f} ms per layer"
    )


def cpu_adamw() -> None:
    torch.set_num_threads(1)
    params = [torch.zeros(2**20, requires_grad=True) for _ in range(64)]
    for p in params:
        p.grad = torch.ones_like(p)
    for foreach in (False, True):
        optimizer = torch.optim.AdamW(params, foreach=foreach)
        optimizer.step()  # the states
        seconds = _median_step(optimizer.step, repeats=7, warmup=2)
        moved = 7 * 4 * sum(p.numel() for p in params)  # the fused kernel's 7 fp32 passes
        print(
            f"CPU AdamW, foreach={foreach}, 64 Mi fp32 parameters: {seconds:.3f} CPU s per step, "
            f"{moved / seconds / 1e9:.1f} GB/s counted at 7 passes"
        )


PARTS = ("kernels", "units", "units-one-rank", "checkpoint-float8", "adamw")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", choices=PARTS, help="default: all of them")
    parts = parser.parse_args().parts or PARTS
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread")
    if "kernels" in parts:
        per_kernel()
    if "units" in parts:
        mp.spawn(_unit_costs, args=(2, 29631), nprocs=2)
    if "units-one-rank" in parts:
        mp.spawn(_unit_costs, args=(1, 29632), nprocs=1)
    if "checkpoint-float8" in parts:
        checkpoint_and_float8()
    if "adamw" in parts:
        cpu_adamw()


if __name__ == "__main__":
    main()
