"""The step-time model (autoshard.predict.speed) and the FLOP profile it rests on
(autoshard.predict.flops), against numbers worked out by hand.

The communication tests use a GPU with round bandwidths, every factor at 1 and no latency, and
``overlap=0`` (nothing hidden), so ``exposed_comm_s`` is the sum of every collective's bytes
over its link: the volumes of each strategy, computed by hand below from the model's sizes.
"""

from __future__ import annotations

import doctest
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import autoshard
from autoshard.analyze import analyze_model
from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.gpus import CATALOGUE
from autoshard.predict import flops as flops_module
from autoshard.predict import host_bound as host_bound_module
from autoshard.predict import speed as speed_module
from autoshard.predict.calibrate import SpeedModel
from autoshard.predict.flops import FlopProfile, profile_flops
from autoshard.predict.hardware import dense_flops, speed_for
from autoshard.predict.optimizer_step import HOST_OPTIMIZER_THREADS, host_optimizer_threads
from autoshard.predict.speed import (
    SpeedFactors,
    default_factors,
    predict_speed,
    under_pressure,
)
from autoshard.predict.work_seconds import AUTOCAST_HOST_RATIO
from autoshard.results import MemoryBreakdown, MemoryEstimate, SpeedEstimate
from autoshard.space import rank_candidates
from tests.predict.linear_chain import WRAP, Chain, profiled

D = 64  # width of every Linear
BLOCKS = 4
INTRA, INTER = 100e9, 25e9  # bytes/s: one GPU's link in a node, one node's network


@pytest.fixture(scope="module")
def net():
    with torch.device("meta"):
        profile, flops = profiled(Chain(D, BLOCKS, head=True))
    assert profile.block_count == BLOCKS and profile.block_params == D * D
    return profile, flops


GPU = CATALOGUE["h100-sxm"].model_copy(
    update={
        "id": "test-gpu",
        "bf16_flops": 1e12,
        "fp16_flops": 1e12,
        "fp32_flops": 0.5e12,
        "tf32_flops": 0.5e12,
        "intra_node_bandwidth": INTRA,
        "inter_node_bandwidth": INTER,
        "host_link_bandwidth": 10e9,
        "hbm_bandwidth": 1e12,
        "matmul_fraction": 1.0,
        "attention_fraction": 1.0,
        # the arithmetic by hand: no fp32 share of its own, no published MFU ceiling
        "fp32_step_efficiency": None,
        "generation": "",
    }
)
EXACT = SpeedFactors(
    compute_efficiency=1.0,
    comm_efficiency=1.0,
    collective_latency_s=0.0,
    memory_efficiency=1.0,
    host_efficiency=1.0,
    host_memory_bandwidth=50e9,
    op_overhead_s=0.0,
    unit_host_scale=0.0,
    overlap=0.0,
)
ONE_NODE = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30)
TWO_NODES = Hardware(gpus_per_node=4, nodes=2, gpu_memory=80 * 2**30)


def comm_seconds(net, candidate: Candidate, hardware: Hardware, **workload: int) -> float:
    profile, flops = net
    speed = predict_speed(
        profile, flops, candidate, hardware, WorkloadSpec(**workload), EXACT, gpu=GPU
    )
    return speed.breakdown.exposed_comm_s


# --------------------------------------------------------------------------------------------
# Communication volumes, by hand
# --------------------------------------------------------------------------------------------

P = 6 * D * D  # every parameter: input, 4 blocks, head
B = D * D  # one block
ROOT = 2 * D * D  # the input and head Linears stay in the root unit


def test_full_shard_gathers_forward_and_backward_and_reduce_scatters(net) -> None:
    # bf16-mixed, FSDP1: gathered in bf16, reduced in bf16 (Lightning's reduce_dtype). Forward
    # gathers every unit; backward gathers the blocks again (FSDP1 keeps the root gathered);
    # every gradient is reduce-scattered once. Ring: 7/8 of each over the GPU's link.
    hand = 7 / 8 * 2 * (P + BLOCKS * B + P) / INTRA
    full = Candidate(wrap_classes=WRAP, sharding="FULL_SHARD")
    assert comm_seconds(net, full, ONE_NODE) == pytest.approx(hand, rel=1e-9)


def test_shard_grad_op_gathers_once(net) -> None:
    hand = 7 / 8 * 2 * (P + P) / INTRA
    grad_op = Candidate(wrap_classes=WRAP, sharding="SHARD_GRAD_OP")
    assert comm_seconds(net, grad_op, ONE_NODE) == pytest.approx(hand, rel=1e-9)


def test_no_shard_all_reduces_the_gradients(net) -> None:
    hand = 2 * 7 / 8 * 2 * P / INTRA
    no_shard = Candidate(wrap_classes=WRAP, sharding="NO_SHARD")
    assert comm_seconds(net, no_shard, ONE_NODE) == pytest.approx(hand, rel=1e-9)


def test_hybrid_shard_inside_the_node_and_all_reduce_across(net) -> None:
    # 2 nodes x 4 GPUs, shard group of 4 inside a node: gathers and reduce-scatters over 3/4 of
    # each unit at the GPU's link; then each GPU all-reduces its quarter with its one peer in
    # the other node, the 4 GPUs of a node sharing its network: 25 GB/s / 4 each.
    inside = 3 / 4 * 2 * (P + BLOCKS * B + P) / INTRA
    across = 2 * 1 / 2 * 2 * (P / 4) / (INTER / 4)
    hybrid = Candidate(wrap_classes=WRAP, sharding="HYBRID_SHARD", hybrid_mesh=(2, 4))
    assert comm_seconds(net, hybrid, TWO_NODES) == pytest.approx(inside + across, rel=1e-9)


def test_full_shard_across_nodes_runs_at_the_network(net) -> None:
    # One ring over 8 GPUs in 2 nodes: each node's network carries the ring's traffic, 25 GB/s
    # for the node's 4 GPUs together, slower than their 100 GB/s links.
    hand = 7 / 8 * 2 * (P + BLOCKS * B + P) / INTER
    full = Candidate(wrap_classes=WRAP, sharding="FULL_SHARD")
    assert comm_seconds(net, full, TWO_NODES) == pytest.approx(hand, rel=1e-9)


def test_fsdp2_regathers_the_root_and_reduces_in_fp32(net) -> None:
    # FSDP2 with every unit resharded: the root is gathered again for backward; gradients
    # reduce-scatter in fp32 (4 bytes) under bf16-mixed.
    hand = 7 / 8 * (2 * (P + P) + 4 * P) / INTRA
    fsdp2 = Candidate(engine="fsdp2", wrap_classes=WRAP, sharding="FULL_SHARD", reshard="all")
    assert comm_seconds(net, fsdp2, ONE_NODE) == pytest.approx(hand, rel=1e-9)
    keep_root = Candidate(engine="fsdp2", wrap_classes=WRAP, reshard="keep_root")
    kept = 7 / 8 * (2 * (P + BLOCKS * B) + 4 * P) / INTRA
    assert comm_seconds(net, keep_root, ONE_NODE) == pytest.approx(kept, rel=1e-9)


def test_fp32_gathers_four_bytes(net) -> None:
    hand = 7 / 8 * 4 * (P + BLOCKS * B + P) / INTRA
    fp32 = Candidate(wrap_classes=WRAP, sharding="FULL_SHARD", precision="32-true")
    assert comm_seconds(net, fp32, ONE_NODE) == pytest.approx(hand, rel=1e-9)


def test_accumulation_gathers_every_micro_batch_and_reduces_once(net) -> None:
    gathers = 7 / 8 * 2 * (P + BLOCKS * B) / INTRA
    reduce = 7 / 8 * 2 * P / INTRA
    full = Candidate(wrap_classes=WRAP, sharding="FULL_SHARD")
    assert comm_seconds(net, full, ONE_NODE, accumulate=4) == pytest.approx(
        4 * gathers + reduce, rel=1e-9
    )


def test_accumulation_reduces_every_micro_batch_where_the_loop_does_not_skip_the_sync(net) -> None:
    # FSDP2 under Lightning's Trainer: its modules have no no_sync, so every micro-batch
    # reduce-scatters (in fp32 under bf16-mixed); a plain loop skips the sync until the last.
    gathers = 7 / 8 * (2 * (P + P)) / INTRA  # FSDP2 regathers the root too (reshard "all")
    reduce = 7 / 8 * 4 * P / INTRA
    fsdp2 = Candidate(engine="fsdp2", wrap_classes=WRAP, sharding="FULL_SHARD", reshard="all")
    lightning = comm_seconds(net, fsdp2, ONE_NODE, accumulate=4)
    assert lightning == pytest.approx(4 * gathers + 4 * reduce, rel=1e-9)
    profile, flops = net
    plain = predict_speed(
        profile, flops, fsdp2, ONE_NODE, WorkloadSpec(accumulate=4, loop="plain"), EXACT, gpu=GPU
    )
    assert plain.breakdown.exposed_comm_s == pytest.approx(4 * gathers + reduce, rel=1e-9)
    # a trainer that reduces every micro-batch whatever the engine (Composer): said explicitly
    full = Candidate(wrap_classes=WRAP, sharding="FULL_SHARD")
    every = predict_speed(
        profile, flops, full, ONE_NODE, WorkloadSpec(accumulate=4), EXACT, gpu=GPU, skip_sync=False
    )
    fsdp1_gathers = 7 / 8 * 2 * (P + BLOCKS * B) / INTRA
    assert every.breakdown.exposed_comm_s == pytest.approx(
        4 * fsdp1_gathers + 4 * 7 / 8 * 2 * P / INTRA, rel=1e-9
    )


def test_one_rank_moves_nothing(net) -> None:
    alone = Hardware(gpus_per_node=1, gpu_memory=80 * 2**30)
    assert comm_seconds(net, Candidate(wrap_classes=WRAP), alone) == 0.0


# --------------------------------------------------------------------------------------------
# Overlap
# --------------------------------------------------------------------------------------------


def test_hiding_communication_costs_the_slowdown_of_the_compute_beside_it(net) -> None:
    profile, flops = net
    slowdown = 0.2
    hiding = EXACT.model_copy(update={"overlap": 1.0, "overlap_slowdown": slowdown})
    # compute much longer than any collective: every hidden collective runs wholly beside
    # compute, which in its time does 1/(1 + slowdown) of the work it would alone
    slow_compute = GPU.model_copy(update={"bf16_flops": 1e6})

    def speed(sharding: str, factors: SpeedFactors = hiding) -> SpeedEstimate:
        candidate = Candidate(wrap_classes=WRAP, sharding=sharding)
        return predict_speed(
            profile, flops, candidate, ONE_NODE, WorkloadSpec(), factors, gpu=slow_compute
        )

    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        parts = speed(sharding).breakdown
        hidden = comm_seconds(net, Candidate(wrap_classes=WRAP, sharding=sharding), ONE_NODE)
        hidden -= parts.exposed_comm_s
        assert hidden > 0
        assert parts.contention_s == pytest.approx(hidden * slowdown / (1 + slowdown), rel=1e-6)
    # FULL_SHARD hides its backward all-gathers too: it pays more than SHARD_GRAD_OP
    assert (
        speed("FULL_SHARD").breakdown.contention_s > speed("SHARD_GRAD_OP").breakdown.contention_s
    )
    # where collectives block the compute (gloo on CPU processes) nothing runs beside it
    blocking = hiding.model_copy(update={"overlap": 0.0})
    assert speed("FULL_SHARD", blocking).breakdown.contention_s == 0.0


def test_one_unit_overlaps_nothing(net) -> None:
    profile, flops = net
    hidden = EXACT.model_copy(update={"overlap": 1.0})
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        one = Candidate(sharding=sharding)
        exposed = predict_speed(profile, flops, one, ONE_NODE, WorkloadSpec(), hidden, gpu=GPU)
        total = comm_seconds(net, one, ONE_NODE)
        assert total > 0
        assert exposed.breakdown.exposed_comm_s == pytest.approx(total, rel=1e-9)
    # per-block units hide some of theirs behind the blocks' compute
    slow_compute = GPU.model_copy(update={"bf16_flops": 1e6})
    wrapped = Candidate(wrap_classes=WRAP)
    some = predict_speed(
        profile, flops, wrapped, ONE_NODE, WorkloadSpec(), hidden, gpu=slow_compute
    )
    assert some.breakdown.exposed_comm_s < 0.5 * comm_seconds(net, wrapped, ONE_NODE)


# --------------------------------------------------------------------------------------------
# Compute, recompute, offload, optimizer
# --------------------------------------------------------------------------------------------


def test_flops_and_memory_traffic_of_linear_blocks(net) -> None:
    _, flops = net
    # per sample: 6 Linears of 2 x D x D forward; backward twice that except the input
    # Linear's input gradient (the batch needs none)
    assert flops.forward == 6 * 2 * D * D
    assert flops.backward == (6 * 2 - 1) * 2 * D * D
    # each block's ReLU reads D floats and writes D; its backward reads the gradient and the
    # output and writes the input's gradient; the matrix products count as FLOPs only
    assert flops.block_forward_traffic == (2 * 4 * D,) * BLOCKS
    assert flops.block_backward_traffic == (3 * 4 * D,) * BLOCKS


def test_compute_is_flops_over_the_peak_and_traffic_over_the_memory(net) -> None:
    profile, flops = net
    for precision, peak, element in (("bf16-mixed", 1e12, 2), ("32-true", 0.5e12, 4)):
        candidate = Candidate(wrap_classes=WRAP, precision=precision, micro_batch_size=3)
        speed = predict_speed(
            profile, flops, candidate, ONE_NODE, WorkloadSpec(accumulate=2), EXACT, gpu=GPU
        )
        # traffic was counted in fp32: bf16 moves half the bytes; HBM is 1e12 bytes/s
        hand = 2 * 3 * (flops.total / peak + flops.traffic * element / 4 / 1e12)
        assert speed.breakdown.compute_s == pytest.approx(hand, rel=1e-9)
        # MFU counts the FLOPs only
        assert speed.mfu == pytest.approx(2 * 3 * flops.total / peak / speed.step_time_s)


def test_a_small_model_is_bound_by_launching_its_operations(net) -> None:
    profile, flops = net
    # per sample: blocks 2 ops forward and 3 backward, the root 2 and 6 (with the loss); at
    # 1 ms an operation the launches outlast the work on a GPU (which runs the kernels while
    # the host launches the next ones), and add to it on a CPU (which does both in turn)
    ops = BLOCKS * (2 + 3) + 2 + 6
    assert sum(flops.block_forward_ops) + sum(flops.block_backward_ops) == BLOCKS * (2 + 3)
    assert flops.other_forward_ops + flops.other_backward_ops == 2 + 6
    slow_host = EXACT.model_copy(update={"op_overhead_s": 1e-3})
    candidate = Candidate(wrap_classes=WRAP, micro_batch_size=4)
    on_gpu = predict_speed(profile, flops, candidate, ONE_NODE, WorkloadSpec(), slow_host, gpu=GPU)
    # under bf16 autocast every kernel passes its dispatch key too (on a GPU's host; a CPU
    # process's measured op cost already holds it)
    assert on_gpu.breakdown.compute_s == pytest.approx(ops * 1e-3 * AUTOCAST_HOST_RATIO, rel=1e-9)
    device = predict_speed(profile, flops, candidate, ONE_NODE, WorkloadSpec(), EXACT, gpu=GPU)
    cpu = GPU.model_copy(update={"id": "cpu-gloo"})
    on_cpu = predict_speed(profile, flops, candidate, ONE_NODE, WorkloadSpec(), slow_host, gpu=cpu)
    # (on the CPU entry bf16 element-wise work moves fp32 bytes: the traffic part doubles)
    cpu_work = predict_speed(profile, flops, candidate, ONE_NODE, WorkloadSpec(), EXACT, gpu=cpu)
    assert cpu_work.breakdown.compute_s > device.breakdown.compute_s
    assert on_cpu.breakdown.compute_s == pytest.approx(
        ops * 1e-3 + cpu_work.breakdown.compute_s, rel=1e-9
    )


def test_an_estimate_without_per_block_parts_is_timed_on_its_flops_alone(net) -> None:
    """A FLOP profile with per-block FLOPs but none of their parts (an estimate made without a
    fake forward) reads as no attention, traffic, launches or new tensors: its blocks take
    their FLOPs over the matrix rate, nothing more."""
    profile, flops = net
    bare = FlopProfile(block_forward=flops.block_forward, block_backward=flops.block_backward)
    assert bare.block_parts("forward", "ops") == (0,) * BLOCKS
    slow_host = EXACT.model_copy(update={"op_overhead_s": 1e-3})
    candidate = Candidate(wrap_classes=WRAP, micro_batch_size=1)
    speed = predict_speed(profile, bare, candidate, ONE_NODE, WorkloadSpec(), slow_host, gpu=GPU)
    peak = dense_flops(GPU, candidate.precision)
    assert speed.breakdown.compute_s == pytest.approx(bare.total / peak, rel=1e-9)


def test_new_tensors_are_counted_per_block(net) -> None:
    _, flops = net
    # per sample, fp32: a block's forward returns the Linear's output and the ReLU's; its
    # backward the ReLU's input gradient, the weight's gradient and the Linear's input gradient
    assert flops.block_forward_fresh == (2 * 4 * D,) * BLOCKS
    assert flops.block_backward_fresh == ((2 * D + D * D) * 4,) * BLOCKS


def test_cpu_processes_pay_fresh_pages_for_new_tensors_and_gathered_parameters(net) -> None:
    """CPU trial workers map every large tensor afresh (their fixed mmap threshold): each new
    tensor of the step, each gathered unit and each reduce-scattered shard is written into new
    pages. On CPU processes nothing overlaps, so the step grows by exactly those bytes over the
    rate of fresh pages; GPUs (no rate) pay nothing."""
    profile, flops = net
    two = Hardware(gpus_per_node=2, gpu_memory=8 * 2**30)
    cpu = GPU.model_copy(update={"id": "cpu-gloo", "fresh_page_bandwidth": None})
    faulting = cpu.model_copy(update={"fresh_page_bandwidth": 1e9})
    candidate = Candidate(wrap_classes=WRAP, precision="32-true", micro_batch_size=3)

    def step(gpu) -> float:
        return predict_speed(profile, flops, candidate, two, WorkloadSpec(), EXACT, gpu=gpu)

    new_tensors = 3 * (
        sum(flops.block_forward_fresh) + sum(flops.block_backward_fresh)
        + flops.other_forward_fresh + flops.other_backward_fresh
    )  # fmt: skip
    # FSDP1 FULL_SHARD, fp32: the root gathered once, each block twice; every unit's gradient
    # reduce-scattered into a half-size shard (2 ranks)
    gathered = 4 * (ROOT + 2 * BLOCKS * B)
    shards = 4 * (ROOT + BLOCKS * B) / 2
    extra = step(faulting).step_time_s - step(cpu).step_time_s
    assert extra == pytest.approx((new_tensors + gathered + shards) / 1e9, rel=1e-9)
    assert new_tensors > 0 and gathered > 0
    on_gpu = GPU.model_copy(update={"fresh_page_bandwidth": None})
    assert step(on_gpu).breakdown.compute_s < step(faulting).breakdown.compute_s


@pytest.mark.parametrize(("checkpointing", "every", "blocks"), [
    ("none", 1, 0), ("all", 1, BLOCKS), ("every_k", 2, BLOCKS // 2),
])  # fmt: skip
def test_recompute_is_the_checkpointed_blocks_forward(net, checkpointing, every, blocks) -> None:
    profile, flops = net
    candidate = Candidate(
        wrap_classes=WRAP,
        checkpointing=checkpointing,
        checkpoint_every=every,
        checkpoint_classes=WRAP if checkpointing != "none" else (),
        micro_batch_size=2,
    )
    speed = predict_speed(profile, flops, candidate, ONE_NODE, WorkloadSpec(), EXACT, gpu=GPU)
    # micro-batch 2; per block and sample 2 x D x D FLOPs at 1e12 FLOP/s and its ReLU's
    # traffic (2 x D values, 2 bytes each in bf16) at 1e12 bytes/s
    hand = 2 * blocks * (2 * D * D / 1e12 + 2 * D * 2 / 1e12)
    assert speed.breakdown.recompute_s == pytest.approx(hand, rel=1e-9)


def test_offload_copies_shards_and_steps_on_the_host(net) -> None:
    # FULL_SHARD over 8: a rank's shard is P / 8 fp32 parameters. Copied to the GPU for the
    # forward gather and the backward regather, the gradient shard back: 3 copies over the host
    # link, counted one after another for FSDP2. The 8 ranks' AdamW steps (foreach: 20 passes of
    # 4 bytes per parameter) stream through the node's host memory together.
    profile, flops = net
    offload = Candidate(wrap_classes=WRAP, cpu_offload=True, engine="fsdp2")
    speed = predict_speed(profile, flops, offload, ONE_NODE, WorkloadSpec(), EXACT, gpu=GPU)
    shard = P / 8
    copies, host = 3 * shard * 4 / 10e9, 8 * shard * 80 / 50e9
    assert speed.breakdown.offload_s == pytest.approx(copies + host, rel=1e-9)
    assert speed.breakdown.optimizer_s == 0.0
    # FSDP1 issues them on their own streams beside the compute (engine.FSDP1Policy)
    fsdp1 = offload.model_copy(update={"engine": "fsdp1"})
    parts = predict_speed(profile, flops, fsdp1, ONE_NODE, WorkloadSpec(), EXACT, gpu=GPU).breakdown
    hidden = max(0.0, copies - parts.compute_s - parts.recompute_s)
    assert parts.offload_s == pytest.approx(hidden + host, rel=1e-9)
    on_gpu = predict_speed(
        profile, flops, offload.model_copy(update={"cpu_offload": False}), ONE_NODE,
        WorkloadSpec(), EXACT, gpu=GPU,
    )  # fmt: skip
    assert on_gpu.breakdown.offload_s == 0.0
    assert on_gpu.breakdown.optimizer_s == pytest.approx(shard * 80 / 1e12, rel=1e-9)
    fused = Candidate(wrap_classes=WRAP, optimizer_impl="fused")
    fused_speed = predict_speed(profile, flops, fused, ONE_NODE, WorkloadSpec(), EXACT, gpu=GPU)
    assert fused_speed.breakdown.optimizer_s == pytest.approx(shard * 28 / 1e12, rel=1e-9)
    # bf16-true keeps parameters, gradients and states in 2 bytes
    bf16 = Candidate(wrap_classes=WRAP, optimizer_impl="fused", precision="bf16-true")
    bf16_speed = predict_speed(profile, flops, bf16, ONE_NODE, WorkloadSpec(), EXACT, gpu=GPU)
    assert bf16_speed.breakdown.optimizer_s == pytest.approx(shard * 14 / 1e12, rel=1e-9)


def test_the_step_is_the_sum_of_its_parts_and_throughput_follows(net) -> None:
    profile, flops = net
    candidate = Candidate(wrap_classes=WRAP, micro_batch_size=4, cpu_offload=True)
    hiding = EXACT.model_copy(update={"overlap": 1.0, "overlap_slowdown": 0.2})
    speed = predict_speed(
        profile, flops, candidate, ONE_NODE, WorkloadSpec(seq_len=16, accumulate=2), hiding,
        gpu=GPU.model_copy(update={"bf16_flops": 1e6}),
    )  # fmt: skip
    parts = speed.breakdown
    assert parts.contention_s > 0 and parts.offload_s > 0
    assert speed.step_time_s == pytest.approx(sum(parts.model_dump().values()))
    assert speed.samples_per_s == pytest.approx(4 * 2 * 8 / speed.step_time_s)
    assert speed.tokens_per_s_per_gpu == pytest.approx(4 * 2 * 16 / speed.step_time_s)


# --------------------------------------------------------------------------------------------
# FLOPs timed (the FLOP profile itself: tests/predict/test_flops.py)
# --------------------------------------------------------------------------------------------


def _gpt_flops(seq: int) -> FlopProfile:
    model = _meta_gpt()
    flops = profile_flops(model, analyze_model(model), WorkloadSpec(seq_len=seq))
    assert flops.measured, flops.note
    return flops


def test_attention_runs_at_its_own_share_of_the_peak() -> None:
    flops = _gpt_flops(128)
    profile = analyze_model(_meta_gpt())
    gpu = GPU.model_copy(update={"matmul_fraction": 0.8, "attention_fraction": 0.25})
    candidate = Candidate(wrap_classes=profile.wrap_policy)
    speed = predict_speed(profile, flops, candidate, ONE_NODE, WorkloadSpec(seq_len=128),
                          EXACT, gpu=gpu)  # fmt: skip
    matmul = flops.total - flops.attention
    hand = matmul / 0.8e12 + flops.attention / 0.25e12 + flops.traffic * 2 / 4 / 1e12
    assert speed.breakdown.compute_s == pytest.approx(hand, rel=1e-9)
    # MFU stays against the datasheet peak
    assert speed.mfu == pytest.approx(flops.total / 1e12 / speed.step_time_s)


def _meta_gpt() -> nn.Module:
    from examples.gpt import build

    with torch.device("meta"):
        return build("1b", n_layer=2, n_head=4, n_kv_head=4, d_model=128, ffn_hidden=256,
                     vocab_size=500)  # fmt: skip


def test_the_seed_guides_transformer_is_counted_on_fake_tensors() -> None:
    """nn.Transformer's decoder asks whether its mask is the causal one, by value; on fake
    tensors the shape answers (autoshard.predict.fakes.causal_masks_by_shape), so Lightning's
    demo Transformer (the FSDP guide's model) is counted, not estimated."""
    from autoshard.analyze import analyze_target
    from autoshard.predict.activations import profile_activations
    from autoshard.predict.fakes import causal_masks_by_shape
    from autoshard.target.resolve import TargetSpec

    root = Path(__file__).resolve().parents[2]
    target = TargetSpec(spec=f"{root}/examples/lightning_transformer.py:build")
    profile, built = analyze_target(target)
    flops = profile_flops(built.model, profile, WorkloadSpec(), batch=built.batch)
    assert flops.measured, flops.note
    assert len(flops.block_forward) == profile.block_count > 0
    acts = profile_activations(built.model, profile, WorkloadSpec(), batch=built.batch)
    assert not acts.note, acts.note
    # a real mask is still checked by its values
    from torch.nn.modules import transformer

    causal = transformer._generate_square_subsequent_mask(4)
    with causal_masks_by_shape():
        assert transformer._detect_is_causal_mask(causal, None, 4) is True
        assert transformer._detect_is_causal_mask(torch.zeros(4, 4), None, 4) is False


# --------------------------------------------------------------------------------------------
# Ranking
# --------------------------------------------------------------------------------------------


def test_ranking_puts_the_fastest_first(net) -> None:
    profile, flops = net
    wrapped = Candidate(wrap_classes=WRAP)
    estimates = [
        MemoryEstimate(
            candidate=c,
            method="analytic",
            gpu_peak=1,
            breakdown=MemoryBreakdown(),
            fits=True,
            headroom=1,
        )
        for c in (wrapped.model_copy(update={"cpu_offload": True}), wrapped)
    ]
    hardware = ONE_NODE.model_copy(update={"gpu": "h100-sxm"})
    gpu, _ = speed_for(hardware)
    model = SpeedModel(profile, flops, hardware, WorkloadSpec(), gpu, default_factors(gpu))
    ranked = rank_candidates(model.attach(estimates))
    assert [e.candidate.cpu_offload for e in ranked] == [False, True]
    assert all(e.speed is not None and e.speed.gpu == "h100-sxm" for e in ranked)
    assert estimates[0].speed is None  # copies: the inputs are unchanged


def _predicted(mbs: int, samples_per_s: float, headroom: int, fits: bool = True) -> MemoryEstimate:
    return MemoryEstimate(
        candidate=Candidate(wrap_classes=WRAP, micro_batch_size=mbs),
        method="analytic",
        gpu_peak=100 - headroom,  # of 100 usable: a headroom of 1 is near the limit
        breakdown=MemoryBreakdown(),
        fits=fits,
        headroom=headroom,
        speed=SpeedEstimate(step_time_s=1 / samples_per_s, samples_per_s=samples_per_s),
    )


def test_predictions_within_the_models_resolution_are_a_tie_that_goes_to_headroom() -> None:
    # 7B on 8 x H100: mbs 2 predicted 4% faster than mbs 1 but at the edge of memory (a tie
    # gives way to headroom only there: tests/test_ranking.py)
    edge, roomy, slow, big = (
        _predicted(2, 100.0, headroom=1),
        _predicted(1, 96.0, headroom=30),
        _predicted(4, 80.0, headroom=50),
        _predicted(8, 120.0, headroom=-5, fits=False),
    )
    ranked = rank_candidates([edge, slow, big, roomy])
    assert [e.candidate.micro_batch_size for e in ranked] == [1, 2, 4, 8]
    # beyond the tie, speed decides whatever the headroom
    assert rank_candidates([_predicted(2, 100.0, 1), _predicted(1, 94.0, 30)])[0].headroom == 1


def test_a_flop_profile_round_trips_as_json(net) -> None:
    _, flops = net
    assert FlopProfile.model_validate_json(flops.model_dump_json()) == flops


@pytest.mark.parametrize(
    "module", [flops_module, speed_module, host_bound_module], ids=["flops", "speed", "host"]
)
def test_the_examples_in_the_docstrings_run(module, monkeypatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # they name examples/gpt.py
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


def test_offload_copies_the_shard_for_every_micro_batch_under_accumulation(net) -> None:
    # accumulate=4: each micro-batch's forward gathers and its backward regathers every unit,
    # each copying the parameter shard to the GPU first (4 x 2 copies); the gradient shard comes
    # back once per step. Counted once per step, offload with accumulation looks too fast.
    profile, flops = net
    offload = Candidate(wrap_classes=WRAP, cpu_offload=True, engine="fsdp2")  # nothing hidden
    shard = P / 8
    optimizer = 8 * shard * 80 / 50e9  # as in the test above: once per step
    for accumulate in (1, 4):
        workload = WorkloadSpec(accumulate=accumulate)
        speed = predict_speed(profile, flops, offload, ONE_NODE, workload, EXACT, gpu=GPU)
        hand = (accumulate * 2 + 1) * shard * 4 / 10e9 + optimizer
        assert speed.breakdown.offload_s == pytest.approx(hand, rel=1e-9)


def test_offload_on_two_ranks_regathers_too(net) -> None:
    # (mutation survivor of predict/speed: the regather rule at the smallest sharded world)
    # two ranks shard the parameters as eight do: backward regathers, copying the shard again
    profile, flops = net
    offload = Candidate(wrap_classes=WRAP, cpu_offload=True, engine="fsdp2")  # nothing hidden
    two = ONE_NODE.model_copy(update={"gpus_per_node": 2})
    shard = P / 2
    # the node's 2 ranks step their shards in host memory, each at most its threads' bandwidth
    # (the trials' 4 threads a rank)
    threads = HOST_OPTIMIZER_THREADS * EXACT.host_thread_bandwidth
    optimizer = shard * 80 / min(50e9 / 2, threads)
    speed = predict_speed(
        profile, flops, offload, two, WorkloadSpec(), EXACT, gpu=GPU,
        host_threads=HOST_OPTIMIZER_THREADS,
    )  # fmt: skip
    assert speed.breakdown.offload_s == pytest.approx(3 * shard * 4 / 10e9 + optimizer, rel=1e-9)


def test_blocks_the_analysis_does_not_wrap_tf32_and_cpu_offload(net) -> None:
    # (mutation survivors of predict/speed, each a number a user would read)
    profile, flops = net
    plain = Candidate(wrap_classes=WRAP)
    wrapped = predict_speed(profile, flops, plain, ONE_NODE, WorkloadSpec(), EXACT, gpu=GPU)
    # the same work when the analysis found no blocks to wrap: one piece, the same seconds
    unwrapped = profile.model_copy(update={"block_count": 0})
    whole = predict_speed(unwrapped, flops, Candidate(), ONE_NODE, WorkloadSpec(), EXACT, gpu=GPU)
    assert whole.breakdown.compute_s == pytest.approx(wrapped.breakdown.compute_s, rel=1e-9)
    # fp32 with TF32 matmuls computes at the TF32 peak (its memory traffic stays as it was)
    fast = GPU.model_copy(update={"tf32_flops": 2 * GPU.fp32_flops})
    fp32 = Candidate(wrap_classes=WRAP, precision="32-true")
    tf32 = predict_speed(profile, flops, fp32, ONE_NODE, WorkloadSpec(), EXACT, gpu=fast, tf32=True)
    full = predict_speed(profile, flops, fp32, ONE_NODE, WorkloadSpec(), EXACT, gpu=fast)
    assert full.breakdown.compute_s / 2 < tf32.breakdown.compute_s < 0.99 * full.breakdown.compute_s
    # CPU processes: the host is the device, so the optimizer's pass over its shard is added to
    # the copies, at the device's memory rate
    cpu = GPU.model_copy(update={"id": "cpu-gloo"})
    offload = Candidate(engine="fsdp2", wrap_classes=WRAP, cpu_offload=True)
    speed = predict_speed(profile, flops, offload, ONE_NODE, WorkloadSpec(), EXACT, gpu=cpu)
    shard = P / 8
    hand = 3 * shard * 4 / 10e9 + shard * 80 / 1e12
    assert speed.breakdown.offload_s == pytest.approx(hand, rel=1e-9)


# --------------------------------------------------------------------------------------------
# What running distributed costs beyond the collectives; memory pressure
# --------------------------------------------------------------------------------------------


def test_distributed_cost_is_zero_on_one_gpu_and_fsdps_copies_on_two(net) -> None:
    # FULL_SHARD, FSDP1, bf16-mixed: forward gathers every unit (P), backward the blocks again
    # (4 B: the root stays gathered), every gradient reduce-scattered once (P, bf16): each
    # element copied once, read and written, at the HBM rate (1 TB/s, efficiency 1).
    profile, flops = net
    full = Candidate(wrap_classes=WRAP, sharding="FULL_SHARD")

    def distributed(gpus: int, candidate: Candidate = full) -> float:
        hardware = Hardware(gpus_per_node=gpus, gpu_memory=80 * 2**30)
        speed = predict_speed(profile, flops, candidate, hardware, WorkloadSpec(), EXACT, gpu=GPU)
        parts = speed.breakdown
        assert speed.step_time_s == pytest.approx(
            parts.compute_s + parts.recompute_s + parts.exposed_comm_s + parts.contention_s
            + parts.offload_s + parts.optimizer_s + parts.distributed_s
        )  # fmt: skip
        return parts.distributed_s

    assert distributed(1) == 0.0
    hand = 2 * (2 * (P + BLOCKS * B) + 2 * P) / 1e12
    assert distributed(2) == pytest.approx(hand, rel=1e-9)
    assert distributed(8) == pytest.approx(hand, rel=1e-9)  # per rank: the unit, whatever n
    # NO_SHARD all-reduces the gradients in place: no copies
    assert distributed(2, Candidate(wrap_classes=WRAP, sharding="NO_SHARD")) == 0.0


def test_memory_pressure_slows_a_candidate_at_the_limit_and_only_there() -> None:
    speed = SpeedEstimate(
        step_time_s=2.0, samples_per_s=8.0, tokens_per_s_per_gpu=1000.0, mfu=0.5, gpu="h100-sxm"
    )
    usable = 100 * 2**30
    f = SpeedFactors()  # 5% margin, 10% at the limit
    assert under_pressure(speed, 90 * 2**30, usable, f) == speed  # room to spare
    assert under_pressure(speed, 95 * 2**30, usable, f) == speed  # the margin's edge
    half = under_pressure(speed, int(97.5 * 2**30), usable, f)
    assert half.step_time_s == pytest.approx(2.0 * 1.05)
    assert half.breakdown.pressure_s == pytest.approx(0.1)
    full = under_pressure(speed, usable, usable, f)
    assert full.step_time_s == pytest.approx(2.2)
    assert full.tokens_per_s_per_gpu == pytest.approx(1000 / 1.1)
    assert full.samples_per_s == pytest.approx(8 / 1.1)
    assert full.mfu == pytest.approx(0.5 / 1.1)
    # beyond the limit it does not fit: ruled out by memory, its speed left alone
    assert under_pressure(speed, usable + 1, usable, f) == speed


@pytest.mark.filterwarnings("ignore::autoshard.NoGPUWarning")
def test_the_plan_warns_when_its_first_candidate_is_at_the_memory_limit() -> None:
    import warnings as _warnings

    from autoshard.errors import PlanWarning
    from autoshard.plan import memory_pressure_note

    with torch.device("meta"):
        model = Chain(D, BLOCKS, head=True)
    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore")
        first = autoshard.estimate(model, batch=torch.randn(2, D), gpus=8, gpu_memory="80GiB")[0]
    assert first.fits and first.speed is not None
    assert memory_pressure_note([first]) is None  # megabytes of 76 GiB: no pressure
    usable = first.gpu_peak + first.headroom
    at_limit = first.model_copy(update={"gpu_peak": usable - 2**20, "headroom": 2**20})
    at_limit = at_limit.model_copy(
        update={"speed": under_pressure(first.speed, at_limit.gpu_peak, usable)}
    )
    note = memory_pressure_note([at_limit])
    assert note is not None and note.startswith("memory pressure:")
    assert "10%" in note and "0.0% to spare" in note
    # the planner raises it as a PlanWarning: planning for GPUs whose memory the model fills
    gib = (first.gpu_peak + 2**20) / 2**30 / 0.95  # usable = 95% of the GPU: just above peak
    with pytest.warns(PlanWarning, match="memory pressure"):
        autoshard.estimate(
            model, batch=torch.randn(2, D), gpus=8, gpu_memory=f"{gib:.6f}GiB", gpu="h100-sxm"
        )


def test_offload_optimizer_of_few_ranks_is_bound_by_its_threads(net) -> None:
    # 2 ranks on a node whose memory streams 50 GB/s: each could have 25 GB/s, but its CPU
    # AdamW runs on the trials' 4 threads (5 GB/s each here): the shard's 80 bytes per
    # parameter at 20 GB/s. FSDP2: its copies counted one after another.
    profile, flops = net
    offload = Candidate(wrap_classes=WRAP, cpu_offload=True, engine="fsdp2")
    two = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30)
    factors = EXACT.model_copy(update={"host_thread_bandwidth": 5e9})
    speed = predict_speed(
        profile, flops, offload, two, WorkloadSpec(), factors, gpu=GPU,
        host_threads=HOST_OPTIMIZER_THREADS,
    )  # fmt: skip
    shard = P / 2
    assert HOST_OPTIMIZER_THREADS == 4
    assert speed.breakdown.offload_s == pytest.approx(3 * shard * 4 / 10e9 + shard * 80 / 20e9)


def test_host_optimizer_threads_are_the_runs(net) -> None:
    # The threads of each rank's host optimizer step are the user's run's, not the trials' 4:
    # the node's cores over its ranks where they are known (Lightning's launchers), else
    # torchrun's 1 a rank where a node has several, and for one rank a node torch's default
    # (every core: only the node's memory bandwidth binds).
    def node(gpus: int, cores: int | None = None) -> Hardware:
        return Hardware(gpus_per_node=gpus, gpu_memory=80 * 2**30, host_cores=cores)

    assert host_optimizer_threads(node(8)) == 1
    assert host_optimizer_threads(node(8, cores=64)) == 8
    assert host_optimizer_threads(node(8, cores=4)) == 1  # at least one a rank
    assert host_optimizer_threads(node(1)) == math.inf
    assert host_optimizer_threads(node(1, cores=16)) == 16
    # and the offload term steps each rank's shard at those threads: 2 ranks a node streaming
    # 50 GB/s, 5 GB/s a thread
    profile, flops = net
    offload = Candidate(wrap_classes=WRAP, cpu_offload=True, engine="fsdp2")
    factors = EXACT.model_copy(update={"host_thread_bandwidth": 5e9})
    shard = P / 2
    copies = 3 * shard * 4 / 10e9
    for cores, rate in ((None, 5e9), (4, 10e9), (64, 25e9)):  # 1 thread, 2, 32 (node-bound)
        speed = predict_speed(
            profile, flops, offload, node(2, cores), WorkloadSpec(), factors, gpu=GPU
        )
        assert speed.breakdown.offload_s == pytest.approx(copies + shard * 80 / rate), cores
    # the trials' own threads, given
    trial = predict_speed(
        profile, flops, offload, node(2, 64), WorkloadSpec(), factors, gpu=GPU,
        host_threads=HOST_OPTIMIZER_THREADS,
    )  # fmt: skip
    assert trial.breakdown.offload_s == pytest.approx(copies + shard * 80 / 20e9)


# --------------------------------------------------------------------------------------------
# The host-bound floor (autoshard.predict.host_bound)
# --------------------------------------------------------------------------------------------


def _decoder_speed(layers: int, width: int, seq: int, mbs: int, gpus: int, gpu: str, **kw):
    """A Llama-style decoder (examples/gpt.py) profiled at ``seq`` tokens, FULL_SHARD on
    ``gpus`` GPUs of one node, with the default factors."""
    from examples.gpt import GPT

    with torch.device("meta"):
        model = GPT(
            n_layer=layers, n_head=max(1, width // 128), n_kv_head=max(1, width // 512),
            d_model=width, ffn_hidden=int(3.5 * width), vocab_size=32000, mlp="swiglu",
            max_seq_len=seq,
        )  # fmt: skip
    profile = analyze_model(model)
    flops = profile_flops(model, profile, WorkloadSpec(seq_len=seq))
    assert flops.measured, flops.note
    hardware = Hardware(gpus_per_node=gpus, gpu_memory=80 * 2**30, gpu=gpu)
    candidate = Candidate(wrap_classes=profile.wrap_policy, micro_batch_size=mbs, **kw)
    return predict_speed(profile, flops, candidate, hardware, WorkloadSpec(seq_len=seq))


def test_a_short_step_of_many_blocks_waits_on_its_host_and_a_long_one_does_not() -> None:
    # 64 blocks at 35 tokens (the FSDP guide's demo shape): 4,000+ kernels and 65 FSDP units
    # for 0.2 TFLOP, so most of the step is the host issuing it
    short = _decoder_speed(64, 1024, 35, 1, 2, "a100-40gb-sxm", precision="32-true")
    assert short.breakdown.host_bound_s > 0.5 * short.step_time_s
    # a Llama 3 8B shape at 8,192 tokens on 8 H100: the GPU's kernels outlast the host's, by
    # so far that their overlap (host_bound.overlapped) leaves next to nothing to wait
    long = _decoder_speed(32, 4096, 8192, 1, 8, "h100-sxm", precision="bf16-mixed")
    assert long.breakdown.host_bound_s < 1e-3 * long.step_time_s
    assert long.step_time_s > 1.0


def test_fsdps_host_cost_per_unit_is_on_the_step_on_one_gpu_and_on_two(net) -> None:
    from autoshard.predict.host_bound import unit_host_seconds

    full = Candidate(wrap_classes=WRAP, sharding="FULL_SHARD", precision="32-true")
    one = Hardware(gpus_per_node=1, gpu_memory=80 * 2**30)
    two = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30)
    # the toy net's 5 units on a GPU whose work is nothing wait for the host alone, on one GPU
    # too (autoshard wraps the model in FSDP there as well)
    profile, flops = net
    hooks_only = EXACT.model_copy(update={"unit_host_scale": 1.0})
    for hw in (one, two):
        speed = predict_speed(profile, flops, full, hw, WorkloadSpec(), hooks_only, gpu=GPU)
        hooks = (BLOCKS + 1) * unit_host_seconds(full, hw)
        assert hooks > 0
        assert speed.step_time_s == pytest.approx(hooks + speed.breakdown.optimizer_s)
    # CPU processes: the host is the device, its costs are in every piece already
    cpu = GPU.model_copy(update={"id": "cpu-gloo"})
    on_cpu = predict_speed(profile, flops, full, two, WorkloadSpec(), hooks_only, gpu=cpu)
    assert on_cpu.breakdown.host_bound_s == 0.0


def test_the_host_bound_term_is_in_the_report_and_the_json() -> None:
    from autoshard.results import SpeedBreakdown
    from autoshard.ui.report import speed_terms

    terms = speed_terms(SpeedBreakdown(compute_s=0.1, host_bound_s=0.2), 0.3)
    assert "host-bound 0.200 s" in terms
    assert SpeedBreakdown(host_bound_s=0.2).model_dump()["host_bound_s"] == 0.2


def test_the_host_issues_every_kernel_of_the_step_recompute_included(net) -> None:
    from autoshard.predict.host_bound import (
        CHECKPOINT_HOST_S_PER_KERNEL,
        MEASURED_OP_S,
        HostStep,
        host_seconds,
    )
    from autoshard.predict.timeline import step_timeline

    profile, flops = net
    one = Hardware(gpus_per_node=1, gpu_memory=80 * 2**30)

    def host(candidate: Candidate, accumulate: int = 1) -> float:
        step = step_timeline(
            candidate, one, WorkloadSpec(accumulate=accumulate), blocks=BLOCKS,
            params=float(profile.total_params), block_params=float(profile.block_params),
        )  # fmt: skip
        # FSDP's hooks at nothing: the kernels (and checkpointing's own Python)
        return host_seconds(
            HostStep(step, profile, flops, candidate, one), op_s=1e-3, unit_scale=0.0
        )

    plain = Candidate(wrap_classes=WRAP, precision="32-true")  # fp32: no autocast per kernel
    kernels = (
        sum(flops.block_forward_ops) + sum(flops.block_backward_ops)
        + flops.other_forward_ops + flops.other_backward_ops
    )  # fmt: skip
    assert host(plain) == pytest.approx(kernels * 1e-3)
    # every micro-batch issues its kernels again
    assert host(plain, accumulate=3) == pytest.approx(3 * kernels * 1e-3)
    # checkpointing every block issues each block's forward again in backward
    every = plain.model_copy(update={"checkpointing": "all", "checkpoint_classes": WRAP})
    wrapper = CHECKPOINT_HOST_S_PER_KERNEL[every.checkpointing] * 1e-3 / MEASURED_OP_S
    forward = sum(flops.block_forward_ops)
    assert host(every) == pytest.approx((kernels + forward) * 1e-3 + forward * wrapper)


def test_recompute_seconds_grow_with_accumulation_under_checkpointing(net) -> None:
    # every micro-batch's backward recomputes its checkpointed blocks again (a mutation that
    # dropped the factor in speed._busy_seconds survived every other test)
    profile, flops = net
    ckpt = Candidate(wrap_classes=WRAP, checkpointing="all", checkpoint_classes=WRAP)

    def recompute(accumulate: int) -> float:
        workload = WorkloadSpec(accumulate=accumulate)
        speed = predict_speed(profile, flops, ckpt, ONE_NODE, workload, EXACT, gpu=GPU)
        return speed.breakdown.recompute_s

    assert recompute(1) > 0
    assert recompute(3) == pytest.approx(3 * recompute(1))
    assert recompute(3) == pytest.approx(3 * recompute(1))


def test_one_gpu_runs_no_collective_and_no_copies_around_them(net) -> None:
    profile, flops = net
    one = Hardware(gpus_per_node=1, gpu_memory=80 * 2**30)
    for engine in ("fsdp1", "fsdp2"):
        candidate = Candidate(engine=engine, wrap_classes=WRAP)
        speed = predict_speed(profile, flops, candidate, one, WorkloadSpec(), gpu=GPU)
        part = speed.breakdown
        assert part.exposed_comm_s == part.contention_s == part.distributed_s == 0.0
        assert part.compute_s > 0


def test_fp32_on_hopper_reaches_its_own_share_tf32_and_16_bit_do_not(net) -> None:
    from autoshard.predict.work_seconds import work_rates

    h200 = CATALOGUE["h200"]
    assert h200.fp32_step_efficiency is not None
    assert h200.fp32_step_efficiency > h200.step_efficiency
    factors = default_factors(h200)
    fp32 = Candidate(wrap_classes=WRAP, precision="32-true")
    bf16 = Candidate(wrap_classes=WRAP)
    cuda_cores = work_rates(fp32, h200, factors, h200.fp32_flops)
    share = h200.fp32_step_efficiency / h200.step_efficiency
    expected = h200.fp32_flops * h200.matmul_fraction * factors.compute_efficiency * share
    assert cuda_cores.flop_s == pytest.approx(expected)
    # TF32 runs on the tensor cores: the tensor cores' share
    tf32 = work_rates(fp32, h200, factors, h200.tf32_flops)
    assert tf32.flop_s == pytest.approx(
        h200.tf32_flops * h200.matmul_fraction * factors.compute_efficiency
    )
    tensor = work_rates(bf16, h200, factors, h200.bf16_flops)
    assert tensor.flop_s == pytest.approx(
        h200.bf16_flops * h200.matmul_fraction * factors.compute_efficiency
    )
    # an entry without an fp32 figure: the same share as 16-bit
    a100 = CATALOGUE["a100-80gb-sxm"]
    assert a100.fp32_step_efficiency is None
    plain = work_rates(fp32, a100, default_factors(a100), a100.fp32_flops)
    assert plain.flop_s == pytest.approx(
        a100.fp32_flops * a100.matmul_fraction * default_factors(a100).compute_efficiency
    )


def test_calibration_compares_trials_as_they_ran_their_host_threads(net, monkeypatch) -> None:
    # A trial steps its host optimizer on the worker group's threads (OMP_NUM_THREADS, else
    # 4); the run planned for on its own (here 64 cores over 2 ranks). A trial measured exactly
    # as predicted for the trial leaves nothing to calibrate: the untried candidates keep the
    # run's uncalibrated prediction. Compared against the run's prediction instead, the fit
    # would take the threads' difference for a slower host.
    from autoshard.predict.calibrate import reorder_untried, trial_host_threads
    from autoshard.results import TrialResult, TrialStatus

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert trial_host_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert trial_host_threads() == HOST_OPTIMIZER_THREADS
    profile, flops = net
    node = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30, host_cores=64)
    prior = EXACT.model_copy(update={"host_thread_bandwidth": 5e9})
    model = SpeedModel(profile, flops, node, WorkloadSpec(), GPU, prior)
    tried = Candidate(wrap_classes=WRAP, cpu_offload=True, engine="fsdp2")
    untried = tried.model_copy(update={"micro_batch_size": 2})
    ran = model.predict_trial(tried, prior).step_time_s
    assert ran > 1.1 * model.predict(tried, prior).step_time_s  # 20 GB/s against 25
    trial = TrialResult(candidate=tried, status=TrialStatus.OK, step_time=ran)
    estimate = MemoryEstimate(
        candidate=untried, method="analytic", gpu_peak=1, breakdown=MemoryBreakdown(),
        fits=True, headroom=1,
    )  # fmt: skip
    again, _ = reorder_untried(
        [estimate], [trial], model.predict, prior, as_tried=model.predict_trial
    )
    assert again[0].speed is not None
    expected = model.predict(untried, prior).step_time_s
    assert again[0].speed.step_time_s == pytest.approx(expected, rel=1e-6)
