"""The host-bound floor's terms (autoshard.predict.host_bound), each against its constant by
hand, each zero where it must be: FSDP's hooks on one GPU, checkpointing's and selective
checkpointing's Python, float8's layers and all-gather hooks, autocast's dispatch, and a
compiled step's fixed cost. The GPU host's scale: tests/predict/test_factors.py."""

from __future__ import annotations

import pytest
import torch

from autoshard.config import Candidate, Engine, Hardware, WorkloadSpec
from autoshard.predict import host_bound
from autoshard.predict.host_bound import (
    CHECKPOINT_HOST_S_PER_KERNEL,
    COMPILED_STEP_HOST_S,
    FLOAT8_FORWARD_SHARE,
    FLOAT8_GATHER_HOST_S,
    FLOAT8_LAYER_HOST_S,
    FSDP_UNIT_HOST_S,
    HostStep,
    host_seconds,
    unit_host_seconds,
)
from autoshard.predict.timeline import step_timeline
from autoshard.predict.work_seconds import AUTOCAST_HOST_RATIO, op_host_seconds
from tests.predict.linear_chain import WRAP, Chain, profiled

D, BLOCKS = 32, 4
ONE = Hardware(gpus_per_node=1, gpu_memory=80 * 2**30)
TWO = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30)


@pytest.fixture(scope="module")
def net():
    with torch.device("meta"):
        return profiled(Chain(D, BLOCKS))


def with_(candidate: Candidate, **fields: object) -> Candidate:
    return Candidate.model_validate({**candidate.model_dump(), **fields})


def host(net, candidate: Candidate, hardware: Hardware = ONE, **kw: float) -> float:
    profile, flops = net
    step = step_timeline(
        candidate, hardware, WorkloadSpec(), blocks=BLOCKS,
        params=float(profile.total_params), block_params=float(profile.block_params),
    )  # fmt: skip
    return host_seconds(HostStep(step, profile, flops, candidate, hardware), op_s=14e-6, **kw)


def test_fsdps_hooks_cost_their_units_on_one_gpu_too() -> None:
    # autoshard's trials and handed-over configurations wrap the model in FSDP on one GPU as
    # well: 1B GPT on one H200, 108-206 ms measured against 51-60 predicted without them
    for engine in ("fsdp1", "fsdp2"):
        full = Candidate(engine=engine, wrap_classes=WRAP)
        assert unit_host_seconds(full, ONE) > 0
    # on one rank FSDP1 runs NO_SHARD, and its hooks cost what FSDP2's do (one-rank probe)
    fsdp1 = unit_host_seconds(Candidate(engine="fsdp1", wrap_classes=WRAP), ONE)
    assert fsdp1 == FSDP_UNIT_HOST_S[(Engine.FSDP2, True, True)]
    # on two ranks the two-rank table: FULL_SHARD's regathers cost more than SHARD_GRAD_OP's
    full = Candidate(wrap_classes=WRAP)
    grad_op = full.model_copy(update={"sharding": "SHARD_GRAD_OP"})
    assert unit_host_seconds(full, TWO) == FSDP_UNIT_HOST_S[(Engine.FSDP1, True, True)]
    assert unit_host_seconds(grad_op, TWO) < unit_host_seconds(full, TWO)


def test_the_units_hooks_are_on_the_one_gpu_step(net) -> None:
    candidate = Candidate(engine="fsdp2", wrap_classes=WRAP, precision="32-true")
    hooks_only = host(net, candidate, unit_scale=1.0) - host(net, candidate, unit_scale=0.0)
    # the blocks and the root, each a unit
    assert hooks_only == pytest.approx((BLOCKS + 1) * FSDP_UNIT_HOST_S[(Engine.FSDP2, True, True)])


def test_each_checkpointed_block_costs_its_forward_kernels_python(net) -> None:
    _, flops = net
    plain = Candidate(wrap_classes=WRAP, precision="32-true")
    base = host(net, plain, unit_scale=0.0)
    forward = flops.block_forward_ops[0]
    for how, every in (("all", 1), ("every_k", 2)):
        ckpt = with_(plain, checkpointing=how, checkpoint_every=every, checkpoint_classes=WRAP)
        recomputed = BLOCKS // every
        # the recomputed kernels, and checkpointing's own Python per kernel of each
        expected = recomputed * forward * (14e-6 + CHECKPOINT_HOST_S_PER_KERNEL[ckpt.checkpointing])
        assert host(net, ckpt, unit_scale=0.0) - base == pytest.approx(expected)
    # op-level selective: its policy on every operation of the forward and of the recompute
    selective = with_(plain, checkpointing="selective", checkpoint_classes=WRAP)
    assert host(net, selective, unit_scale=0.0) - base > BLOCKS * forward * 100e-6


def test_float8_costs_its_layers_and_their_gathers_eager_and_the_gathers_compiled(net) -> None:
    eager = Candidate(engine="fsdp2", wrap_classes=WRAP, float8=True)
    plain = with_(eager, float8=False)
    layers = 1.0  # one converted Linear per block
    # no float8 layer, no cost
    assert host(net, plain, float8_layers=layers) == host(net, plain, float8_layers=0.0)
    extra = host(net, eager, float8_layers=layers) - host(net, eager, float8_layers=0.0)
    gathers = 2 * BLOCKS * layers * FLOAT8_GATHER_HOST_S  # gathered again in backward
    assert extra == pytest.approx(BLOCKS * layers * FLOAT8_LAYER_HOST_S + gathers)
    # compiled blocks fuse the casts: the all-gather hooks stay
    compiled = with_(eager, compile=True)
    extra = host(net, compiled, float8_layers=layers) - host(net, compiled, float8_layers=0.0)
    assert extra == pytest.approx(gathers)
    # a recomputed block casts its inputs again (its forward's share)
    ckpt = with_(eager, checkpointing="all", checkpoint_classes=WRAP)
    with_rerun = host(net, ckpt, float8_layers=layers) - host(net, ckpt, float8_layers=0.0)
    rerun = BLOCKS * layers * FLOAT8_FORWARD_SHARE * FLOAT8_LAYER_HOST_S
    assert with_rerun == pytest.approx(BLOCKS * layers * FLOAT8_LAYER_HOST_S + gathers + rerun)


def test_autocast_makes_each_kernel_dearer_and_compile_costs_a_step(net) -> None:
    fp32 = Candidate(wrap_classes=WRAP, precision="32-true")
    assert op_host_seconds(fp32, 1.0) == 1.0
    assert op_host_seconds(with_(fp32, precision="bf16-mixed"), 1.0) == AUTOCAST_HOST_RATIO
    compiled = with_(fp32, compile=True)
    # the compiled step's fixed cost on top of its (fewer, here the same) kernels
    assert host(net, compiled, unit_scale=0.0) - host(net, fp32, unit_scale=0.0) == (
        pytest.approx(COMPILED_STEP_HOST_S)
    )
    # every recipe cost scales with the host's speed per kernel (op_s)
    profile, flops = net
    step = step_timeline(
        compiled, ONE, WorkloadSpec(), blocks=BLOCKS, params=float(profile.total_params),
        block_params=float(profile.block_params),
    )  # fmt: skip
    slow = host_seconds(HostStep(step, profile, flops, compiled, ONE), op_s=28e-6, unit_scale=0.0)
    fast = host_seconds(HostStep(step, profile, flops, compiled, ONE), op_s=14e-6, unit_scale=0.0)
    assert slow == pytest.approx(2 * fast)


def test_the_module_documents_why_it_binds_on_one_gpu() -> None:
    assert "108-206 ms" in (host_bound.__doc__ or "")


def test_host_and_gpu_overlap_fully_only_where_one_is_far_ahead(net) -> None:
    # their HOST_DEVICE_NORM-norm: the longer where one is far ahead, 2^(1/p) of either where
    # they are equal, never more than the sum; nothing where the host is the device
    from autoshard.predict.host_bound import HOST_DEVICE_NORM, host_bound_seconds, overlapped

    p = HOST_DEVICE_NORM
    assert overlapped(0.0, 0.5) == 0.5 and overlapped(0.5, 0.0) == 0.5
    assert overlapped(1.0, 1.0) == pytest.approx(2 ** (1 / p)) and 1 < 2 ** (1 / p) < 2
    assert overlapped(0.1, 1.0) == pytest.approx(1.0, rel=1e-3)  # 10x ahead: the longer
    assert overlapped(0.6, 0.8) < 1.4
    # the step waits on its host by what the overlap adds to the GPU's work before its tail
    profile, flops = net
    candidate = Candidate(engine="fsdp2", wrap_classes=WRAP)
    step = step_timeline(
        candidate, ONE, WorkloadSpec(), blocks=BLOCKS,
        params=float(profile.total_params), block_params=float(profile.block_params),
    )  # fmt: skip
    issued = HostStep(step, profile, flops, candidate, ONE)
    issuing = host_seconds(issued, op_s=14e-6)
    kw = {"op_s": 14e-6, "tail_s": 0.01, "host_is_device": False}
    waits = host_bound_seconds(issued, device_s=issuing + 0.01, **kw)  # GPU work = the host's
    assert waits == pytest.approx((2 ** (1 / p) - 1) * issuing)
    far = 10 * issuing  # the GPU 10x ahead: next to nothing
    assert 0 < host_bound_seconds(issued, device_s=far, **kw) < 1e-3 * far
    cpu = {**kw, "host_is_device": True}
    assert host_bound_seconds(issued, device_s=issuing, **cpu) == 0.0
