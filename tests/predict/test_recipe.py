"""What torch.compile and float8 change in a step's time and memory (predict/recipe.py), on a
small Llama-shaped decoder profiled as the planner does. Moved from tests/test_compile_float8.py,
which keeps where they are planned and what the stacks get."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autoshard.config import Candidate, Engine, Precision, WorkloadSpec
from autoshard.gpus import CATALOGUE
from autoshard.sharding import float8_linears

# ---------------------------------------------------------------------------------------------
# The step-time and memory terms (predict/recipe.py)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama() -> dict[str, Any]:
    """A small Llama-shaped decoder (SwiGLU, RMSNorm, GQA) profiled as the planner does."""
    from autoshard import analyze_model, profile_activations
    from autoshard.predict.flops import profile_flops
    from autoshard.predict.recipe import linear_shapes
    from examples.gpt import GPT

    with torch.device("meta"):
        model = GPT(
            n_layer=4, n_head=8, n_kv_head=2, d_model=512, ffn_hidden=1408, vocab_size=1024,
            mlp="swiglu", max_seq_len=512, tie_embeddings=False,
        )  # fmt: skip
    profile = analyze_model(model)
    workload = WorkloadSpec(seq_len=512)
    return {
        "model": model,
        "profile": profile,
        "workload": workload,
        "flops": profile_flops(model, profile, workload),
        "acts": profile_activations(model, profile, workload, precisions=("bf16-mixed",)),
        "linears": linear_shapes(model, profile),
    }


def speed_of(llama: dict[str, Any], gpu: str = "h100-sxm", spec: Any = None, **fields: Any) -> Any:
    from autoshard.config import Hardware
    from autoshard.gpus import gpu_spec
    from autoshard.predict.speed import default_factors, predict_speed

    p = llama["profile"]
    # device-bound: no host costs (the host floor has its own tests, predict/test_host_bound.py)
    fields.setdefault("micro_batch_size", 256)
    candidate = Candidate(engine=Engine.FSDP2, wrap_classes=p.wrap_policy, **fields)
    hardware = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30, gpu=gpu)
    factors = default_factors(spec or gpu_spec(gpu)).model_copy(
        update={"op_overhead_s": 0.0, "unit_host_scale": 0.0}
    )
    return predict_speed(
        p, llama["flops"], candidate, hardware, llama["workload"], factors, gpu=spec,
        linears=llama["linears"],
    )  # fmt: skip


def test_linear_shapes_are_the_block_linears_float8_converts(llama: dict[str, Any]) -> None:
    p, linears = llama["profile"], llama["linears"]
    converted = float8_linears(llama["model"], Candidate(wrap_classes=p.wrap_policy))
    assert len(converted) == 5 * 4  # q, kv, o, and the SwiGLU's fused gate/up and down
    assert linears.inputs == sum(m.in_features for m in converted) / 4
    assert linears.params == sum(m.weight.numel() for m in converted) / 4
    assert linears.params < p.block_params  # the norms' weights are not converted


def test_compile_takes_the_fused_traffic_off_compute(llama: dict[str, Any]) -> None:
    from autoshard.predict.recipe import COMPILE_TRAFFIC_KEPT

    eager = speed_of(llama)
    compiled = speed_of(llama, compile=True)
    e, c = eager.breakdown, compiled.breakdown
    assert e.compile_saving_s == e.float8_matmul_saving_s == e.float8_cast_s == 0.0
    busy = e.compute_s + e.recompute_s
    # what it reports saving is what left compute, and the step is that much shorter
    assert c.compile_saving_s > 0.02 * busy
    assert c.compute_s + c.recompute_s == pytest.approx(busy - c.compile_saving_s, rel=1e-6)
    assert compiled.step_time_s < eager.step_time_s - 0.9 * c.compile_saving_s
    # the saving is the memory-bound share: none where nothing is memory-bound
    no_traffic = llama["flops"].model_copy(
        update={k: (0,) * 4 for k in ("block_forward_traffic", "block_backward_traffic")}
        | {k: (1,) * 4 for k in ("block_forward_ops", "block_backward_ops")}
    )
    bare = speed_of({**llama, "flops": no_traffic}, compile=True)
    assert bare.breakdown.compile_saving_s < 0.05 * c.compile_saving_s
    assert 0 < COMPILE_TRAFFIC_KEPT < 1


def test_compile_takes_the_eager_memory_bound_time_the_traffic_term_does_not_show(
    llama: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU compile saves EAGER_MEMORY_BOUND_OVER_TRAFFIC times what fusing the counted
    traffic alone saves, the rest off the matrix products' seconds (where the eager step's
    compute efficiency carries it), never more than that efficiency leaves of them; the same
    with float8; CPU workers get the traffic term only."""
    from autoshard.gpus import CATALOGUE
    from autoshard.predict import recipe

    def compiled(scale: float, gpu: str = "h100-sxm", **fields: Any) -> Any:
        monkeypatch.setattr(recipe, "EAGER_MEMORY_BOUND_OVER_TRAFFIC", scale)
        return speed_of(llama, gpu=gpu, compile=True, **fields).breakdown

    assert recipe.EAGER_MEMORY_BOUND_OVER_TRAFFIC > 1
    # d 512: the traffic term is large against the products, so a small scale stays uncapped
    traffic_only, full = compiled(1.0), compiled(1.2)
    assert full.compile_saving_s == pytest.approx(1.2 * traffic_only.compile_saving_s, rel=0.01)
    eager = speed_of(llama).breakdown
    busy = eager.compute_s + eager.recompute_s
    assert full.compute_s + full.recompute_s == pytest.approx(
        busy - full.compile_saving_s, rel=1e-6
    )
    # float8 takes the same seconds off the products whether compile took some or not
    f8_traffic_only, f8 = compiled(1.0, float8=True), compiled(1.2, float8=True)
    assert f8.compile_saving_s == pytest.approx(full.compile_saving_s, rel=1e-6)
    assert f8.float8_matmul_saving_s == pytest.approx(f8_traffic_only.float8_matmul_saving_s)
    # a large scale is capped: at most (1 - step_efficiency) of the products' seconds go
    slack = 1 - CATALOGUE["h100-sxm"].step_efficiency
    capped = compiled(100.0)
    beyond_traffic = capped.compile_saving_s - traffic_only.compile_saving_s
    assert 0 < beyond_traffic <= slack * busy
    assert capped.compile_saving_s == pytest.approx(compiled(1000.0).compile_saving_s)
    # CPU trial workers: their memory-bound work has its own rates, no hidden share
    cpu = compiled(recipe.EAGER_MEMORY_BOUND_OVER_TRAFFIC, gpu="cpu-gloo").compile_saving_s
    assert cpu == pytest.approx(compiled(1.0, gpu="cpu-gloo").compile_saving_s, rel=1e-9)
    assert cpu > 0


def test_float8_runs_the_block_matmuls_at_the_fp8_rate(llama: dict[str, Any]) -> None:
    from autoshard.predict.recipe import FP8_MATMUL_EFFICIENCY

    compiled = speed_of(llama, compile=True)
    both = speed_of(llama, compile=True, float8=True)
    b = both.breakdown
    assert b.float8_matmul_saving_s > 0 and b.float8_cast_s > 0 and b.float8_scale_sync_s > 0
    assert b.compile_saving_s == pytest.approx(compiled.breakdown.compile_saving_s)
    # the casts: each linear's input twice (forward, and again for the weight gradient), each
    # output gradient once, CAST_PASSES compute-dtype passes each, at every one of 512 tokens
    from autoshard.predict.recipe import CAST_PASSES, RecipeStep

    p, lin = llama["profile"], llama["linears"]
    c = Candidate(engine=Engine.FSDP2, wrap_classes=p.wrap_policy, float8=True)
    fwd, bwd = RecipeStep.of(c, llama["flops"], CATALOGUE["h100-sxm"], p, lin).cast_traffic()
    assert fwd == pytest.approx([CAST_PASSES * 4 * lin.inputs * 512] * 4, rel=1e-3)
    assert bwd == pytest.approx([CAST_PASSES * 4 * (lin.inputs + lin.outputs) * 512] * 4, rel=1e-3)
    # at d 512 the casts cost more than the fp8 rate saves: slower, as torchao's README
    # measures small linears (0.80x at M, K, N = 1024, 2048, 1024)
    assert both.step_time_s > compiled.step_time_s
    busy = compiled.breakdown.compute_s + compiled.breakdown.recompute_s
    assert b.compute_s + b.recompute_s == pytest.approx(
        busy - b.float8_matmul_saving_s + b.float8_cast_s, rel=1e-6
    )
    # an fp8 peak no faster than bf16 after its efficiency: nothing saved on the matmuls
    h100 = CATALOGUE["h100-sxm"]
    flat = h100.model_copy(update={"fp8_flops": h100.bf16_flops / FP8_MATMUL_EFFICIENCY})
    same = speed_of(llama, spec=flat, compile=True, float8=True).breakdown
    assert abs(same.float8_matmul_saving_s) < 0.01 * b.float8_matmul_saving_s
    assert same.float8_cast_s == pytest.approx(b.float8_cast_s)


def test_float8_gathers_the_converted_weights_in_one_byte(llama: dict[str, Any]) -> None:
    from autoshard.config import Hardware
    from autoshard.predict.collectives import Collectives
    from autoshard.predict.recipe import RecipeStep

    p = llama["profile"]
    candidate = Candidate(engine=Engine.FSDP2, wrap_classes=p.wrap_policy, float8=True)
    step = RecipeStep.of(candidate, llama["flops"], CATALOGUE["h100-sxm"], p, llama["linears"])
    share = llama["linears"].params / p.block_params
    assert step.gather_scale == pytest.approx(1 - share / 2)
    hardware = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30, gpu="h100-sxm")
    eager = Collectives(
        candidate.model_copy(update={"float8": False}), hardware, CATALOGUE["h100-sxm"],
        latency_s=0.0, efficiency=1.0,
    )  # fmt: skip
    assert eager.gather_bytes * step.gather_scale < 0.55 * eager.gather_bytes
    # slow links: the exposed gathers shrink with the bytes
    slow = CATALOGUE["h100-sxm"].model_copy(update={"intra_node_bandwidth": 2e9})
    bf16 = speed_of(llama, spec=slow)
    fp8 = speed_of(llama, spec=slow, float8=True)
    assert fp8.breakdown.exposed_comm_s < 0.8 * bf16.breakdown.exposed_comm_s


def test_compile_saves_fewer_activations_and_float8_the_same(llama: dict[str, Any]) -> None:
    from autoshard.config import Hardware
    from autoshard.predict.analytic import estimate_memory
    from autoshard.predict.recipe import COMPILE_SAVED_KEPT

    p = llama["profile"]
    hardware = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30, gpu="h100-sxm")

    def activations(**fields: Any) -> int:
        c = Candidate(engine=Engine.FSDP2, wrap_classes=p.wrap_policy, **fields)
        est = estimate_memory(p, c, hardware, llama["workload"], activations=llama["acts"])
        return est.breakdown.activations

    eager, compiled = activations(), activations(compile=True)
    acts = llama["acts"].at("bf16-mixed")
    beyond_inputs = sum(
        b - i for b, i in zip(acts.block_bytes, acts.block_input_bytes, strict=True)
    )
    assert eager - compiled == pytest.approx((1 - COMPILE_SAVED_KEPT) * beyond_inputs, rel=0.02)
    assert activations(float8=True) == eager
    # checkpointed blocks keep their inputs only: compile changes nothing there
    every = {"checkpointing": "all", "checkpoint_classes": p.wrap_policy}
    assert activations(**every) == activations(compile=True, **every)


def test_the_run_flops_are_computed_once_for_the_candidates_that_share_them(
    llama: dict[str, Any],
) -> None:
    """RecipeStep.flops is shared by candidates that differ only where it does not look (batch
    size, sharding) and equal to a fresh computation for every recipe, engine, precision, GPU
    and breakdown switch."""
    from autoshard.predict import recipe

    p, flops, linears = llama["profile"], llama["flops"], llama["linears"]
    switches = [{}, {"float8": False}, {"casts": False}, {"compile": False}]
    for gpu in ("h100-sxm", "a100-80gb-sxm", "cpu-gloo"):
        for compile_, float8, engine, precision, wrap in [
            (True, False, Engine.FSDP1, Precision.BF16_MIXED, True),
            (True, False, Engine.FSDP2, Precision.BF16_MIXED, True),
            (True, False, Engine.FSDP2, Precision.BF16_MIXED, False),
            (True, False, Engine.FSDP2, Precision.FP32, True),
            (False, True, Engine.FSDP2, Precision.BF16_MIXED, True),
            (True, True, Engine.FSDP2, Precision.BF16_TRUE, True),
        ]:
            candidate = Candidate(
                engine=engine, precision=precision, compile=compile_, float8=float8,
                wrap_classes=p.wrap_policy if wrap else (),
            )  # fmt: skip
            if float8 and not CATALOGUE[gpu].fp8_flops:
                continue
            step = recipe.RecipeStep.of(candidate, flops, CATALOGUE[gpu], p, linears)
            for flags in switches:
                fresh = step._run_flops(**{"compile": True, "float8": True, "casts": True, **flags})
                assert step.flops(**flags) == fresh, (gpu, candidate, flags)
            bigger = candidate.model_copy(update={"micro_batch_size": 4, "sharding": "NO_SHARD"})
            again = recipe.RecipeStep.of(bigger, flops, CATALOGUE[gpu], p, linears)
            assert again.flops() is step.flops()  # shared, not recomputed
