"""torch.compile and float8 as planning dimensions: where they are planned, how a pin that cannot
hold is refused, what labels and JSON carry, and that trials and ``rec.apply`` apply them."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from typer.testing import CliRunner

import autoshard
from autoshard import predict
from autoshard.cli import app
from autoshard.config import Candidate, Engine, Precision, TuneOptions, WorkloadSpec
from autoshard.errors import ConfigError, HandoverNotice
from autoshard.gpus import CATALOGUE
from autoshard.results import TrialStatus
from autoshard.sharding import cpu_workers_cannot_run, float8_linears

from .conftest import EXAMPLES, TARGETS

GPT_TINY = f"{EXAMPLES}/gpt.py:build"


def plan(gpu: str, **options: Any) -> list[Candidate]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimates = autoshard.estimate(
            GPT_TINY, kwargs={"size": "tiny"}, gpus=8, gpu=gpu, batch_size=1, seq_len=64,
            **options,
        )  # fmt: skip
    return [e.candidate for e in estimates]


@pytest.fixture
def unmodelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The predictors declaring neither compile nor float8 (as before predict/recipe.py): what
    the plan does with a dimension it cannot predict."""
    monkeypatch.setattr(predict, "MODELLED_DIMENSIONS", frozenset(), False)


# ---------------------------------------------------------------------------------------------
# Where they are planned
# ---------------------------------------------------------------------------------------------


def test_the_catalogue_says_which_gpus_have_fp8() -> None:
    with_fp8 = {i for i, spec in CATALOGUE.items() if spec.fp8_flops}
    assert with_fp8 == {"h100-sxm", "h100-pcie", "h200", "h200-nvl", "b200", "l4", "l40s", "mi300x"}
    for i in with_fp8:  # the dense rate, and where it comes from
        spec = CATALOGUE[i]
        assert spec.fp8_flops is not None and spec.fp8_flops >= 1.9 * spec.bf16_flops
        assert any("FP8" in s for s in spec.sources) and any("torchao" in s for s in spec.sources)


def test_the_predictors_model_compile_and_float8() -> None:
    assert {"compile", "float8"} <= predict.MODELLED_DIMENSIONS


@pytest.mark.usefixtures("unmodelled")
def test_unmodelled_dimensions_are_not_proposed() -> None:
    """Until predict models them, a compiled or float8 candidate would be predicted exactly as
    the eager one: the space leaves them out rather than pick between equals."""
    candidates = plan("h100-sxm", engine="fsdp2")
    assert not any(c.compile or c.float8 for c in candidates)


def test_float8_is_planned_only_where_it_goes() -> None:
    h100 = plan("h100-sxm", engine="fsdp2")
    float8 = [c for c in h100 if c.float8]
    assert float8 and {c.precision for c in float8} == {Precision.BF16_MIXED}
    assert {c.compile for c in h100} == {False, True}
    # the same model and flags, on GPUs without fp8, or with FSDP1: none
    assert not any(c.float8 for c in plan("a100-80gb-sxm", engine="fsdp2"))
    fsdp1 = plan("h100-sxm", engine="fsdp1")
    assert not any(c.float8 for c in fsdp1) and any(c.compile for c in fsdp1)
    # pinned off: none, and only the eager runs
    pinned = plan("h100-sxm", engine="fsdp2", float8=False, compile=False)
    assert not any(c.float8 or c.compile for c in pinned)


@pytest.mark.usefixtures("unmodelled")
def test_pinned_compile_and_float8_plan_them_and_say_they_are_not_modelled() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimates = autoshard.estimate(
            GPT_TINY, kwargs={"size": "tiny"}, gpus=8, gpu="h100-sxm", engine="fsdp2",
            batch_size=1, seq_len=64, compile=True, float8=True,
        )  # fmt: skip
    assert all(e.candidate.compile and e.candidate.float8 for e in estimates)
    # float8 pinned keeps the bf16 precisions of the default bf16-mixed, 32-true
    assert {e.candidate.precision for e in estimates} == {Precision.BF16_MIXED}
    lines = [str(w.message) for w in caught if issubclass(w.category, autoshard.PlanWarning)]
    assert any(line.startswith("torch.compile: its effect") for line in lines)
    assert any(line.startswith("float8: its effect") for line in lines)


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"gpu": "a100-80gb-sxm", "engine": "fsdp2"}, "has no fp8 tensor cores"),
        ({"gpu": "h100-sxm", "engine": "fsdp1"}, "FSDP1 has no float8 all-gather"),
        ({"gpu": "h100-sxm", "engine": "fsdp2", "precision": "32-true"}, "bf16 compute"),
    ],
)
def test_a_pinned_float8_that_cannot_hold_is_one_line(options: dict[str, Any], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        plan(float8=True, **options)


def test_the_command_line_refuses_float8_on_an_a100_in_one_line() -> None:
    result = CliRunner().invoke(
        app,
        ["estimate", GPT_TINY, "--arg", "size=tiny", "--gpus", "8", "--gpu", "a100-80gb-sxm",
         "--engine", "fsdp2", "--float8", "--batch-size", "1"],
    )  # fmt: skip
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "NVIDIA A100 SXM4 80GB has no fp8 tensor cores" in errors[0]
    assert "Traceback" not in result.output


def test_candidate_refuses_float8_without_fsdp2_or_bf16() -> None:
    with pytest.raises(ValidationError, match="float8 needs engine fsdp2"):
        Candidate(float8=True)
    with pytest.raises(ValidationError, match="bf16 compute"):
        Candidate(engine=Engine.FSDP2, float8=True, precision=Precision.FP32)


def test_float8_is_never_planned_on_a_gpu_without_fp8() -> None:
    """Every catalogue GPU, FSDP2 and bf16 allowed: float8 planned exactly where fp8 tensor
    cores are (the catalogue's ``fp8_flops``), compile wherever torch compiles."""
    from autoshard.config import Hardware
    from autoshard.plan import PlanOptions, planned_switches

    options = PlanOptions(engine="fsdp2")
    for gpu_id, spec in CATALOGUE.items():
        if gpu_id == "cpu-gloo":
            continue
        hardware = Hardware(gpus_per_node=8, gpu_memory=spec.memory, gpu=gpu_id)
        compiles, float8s, _ = planned_switches(options, hardware)
        assert (True in float8s) == bool(spec.fp8_flops), gpu_id
        assert compiles == (False, True), gpu_id


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


def test_estimate_json_and_the_report_carry_the_terms() -> None:
    import json

    from autoshard.ui.report import report_data

    result = CliRunner().invoke(
        app,
        ["estimate", GPT_TINY, "--arg", "size=tiny", "--gpus", "8", "--gpu", "h100-sxm",
         "--engine", "fsdp2", "--compile", "--float8", "--batch-size", "1", "--seq-len", "64",
         "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    breakdowns = [e["speed"]["breakdown"] for e in data["estimates"]]
    assert breakdowns and all(b["compile_saving_s"] > 0 for b in breakdowns)
    assert all(b["float8_scale_sync_s"] > 0 for b in breakdowns)
    # the tiny model is launch-bound on an H100: its casts and fp8 rate may not show, but say so
    assert all({"float8_matmul_saving_s", "float8_cast_s"} <= set(b) for b in breakdowns)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = autoshard.recommend(
            GPT_TINY, kwargs={"size": "tiny"}, gpus=8, gpu="h100-sxm", engine="fsdp2",
            batch_size=1, seq_len=64, compile=True,
        )  # fmt: skip
    line = report_data(rec)["summary"]["settings"]["predicted step"]
    assert "torch.compile saved" in line and line.endswith(" s")


# ---------------------------------------------------------------------------------------------
# Labels and JSON
# ---------------------------------------------------------------------------------------------


def test_labels_show_them_and_the_defaults_are_unchanged() -> None:
    eager = Candidate(engine=Engine.FSDP2, wrap_classes=("gpt.Block",))
    assert eager.label() == "fsdp2 FULL_SHARD bf16-mixed mbs1"
    both = eager.model_copy(update={"compile": True, "float8": True})
    assert both.label() == "fsdp2 FULL_SHARD bf16-mixed +compile +fp8 mbs1"
    # JSON written before these fields existed still loads, as the eager run
    old = eager.model_dump(mode="json")
    del old["compile"], old["float8"]
    assert Candidate.model_validate(old) == eager


def test_the_recommendation_round_trips_through_json(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = autoshard.recommend(
            GPT_TINY, kwargs={"size": "tiny"}, gpus=8, gpu="h100-sxm", engine="fsdp2",
            batch_size=1, seq_len=64, compile=True, float8=True,
        )  # fmt: skip
    path = tmp_path / "rec.json"
    path.write_text(rec.model_dump_json())
    again = autoshard.load(path)
    assert again.chosen.candidate == rec.chosen.candidate
    assert again.chosen.candidate.compile and again.chosen.candidate.float8
    assert any(r.startswith("compile True") for r in rec.reasons)
    assert not any("not modelled yet" in r for r in rec.reasons)


# ---------------------------------------------------------------------------------------------
# What the stacks get
# ---------------------------------------------------------------------------------------------


def test_exports_express_compile_or_say_how() -> None:
    from autoshard.emit.text import accelerate_config, hf_trainer_config, lightning_cli_yaml
    from tests.test_emit import candidate, make_rec

    fsdp2 = make_rec(candidate(engine=Engine.FSDP2, compile=True, float8=True))
    config, notes = accelerate_config(fsdp2)
    assert config["dynamo_config"] == {
        "dynamo_backend": "INDUCTOR",
        "dynamo_use_regional_compilation": True,
    }
    assert any("apply_float8" in n for n in notes)
    args, notes = hf_trainer_config(fsdp2)
    assert args["torch_compile"] is True and any("apply_float8" in n for n in notes)
    yaml_text = lightning_cli_yaml(fsdp2)
    assert "# torch.compile: each block compiled" in yaml_text and "# float8:" in yaml_text
    fsdp1 = make_rec(candidate(compile=True))
    assert "model.compile() after wrapping" in lightning_cli_yaml(fsdp1)
    assert accelerate_config(fsdp1)[0]["dynamo_config"]["dynamo_use_regional_compilation"] is False
    # and nothing about them where they are off
    assert "compile" not in lightning_cli_yaml(make_rec(candidate()))


def test_cpu_workers_skip_float8_with_the_reason() -> None:
    why = cpu_workers_cannot_run(Candidate(engine=Engine.FSDP2, float8=True))
    assert why is not None and why.startswith("float8 needs fp8 tensor cores")
    assert cpu_workers_cannot_run(Candidate(engine=Engine.FSDP2, compile=True)) is None


def test_cpu_workers_skip_compile_where_inductor_has_no_compiler() -> None:
    import torch._inductor.config as inductor

    from autoshard import sharding

    # torch's own patch: torch 2.11's config breaks every later compile after a monkeypatch
    # of cpp.cxx is undone ("torch._inductor.config.cpp.cxx does not exist")
    try:
        with inductor.patch({"cpp.cxx": ("autoshard-no-such-compiler",)}):
            sharding.cpu_compiler_missing.cache_clear()
            why = cpu_workers_cannot_run(Candidate(engine=Engine.FSDP2, compile=True))
    finally:
        sharding.cpu_compiler_missing.cache_clear()
    assert why is not None and why.startswith("torch.compile on CPU processes needs a C++")
    assert cpu_workers_cannot_run(Candidate(engine=Engine.FSDP2)) is None


@pytest.fixture
def one_rank_group() -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def gpt_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


@pytest.mark.usefixtures("gpt_importable", "one_rank_group")
@pytest.mark.parametrize("engine", [Engine.FSDP2, Engine.FSDP1])
def test_apply_compiles_the_blocks(engine: Engine) -> None:
    """rec.apply compiles in place what the trials compile: each block under FSDP2 (not the
    root), the wrapped model under FSDP1; parameter names stay the eager model's."""
    import gpt

    from tests.test_emit import candidate, make_rec

    model = gpt.build("tiny")
    names = [n for n, _ in model.named_parameters()]
    with pytest.warns(HandoverNotice, match="torch.compile"):
        applied = make_rec(candidate(engine=engine, compile=True)).apply(model)
    compiled = [m for m in applied.modules() if getattr(m, "_compiled_call_impl", None)]
    if engine is Engine.FSDP2:
        assert [type(m).__name__ for m in compiled] == ["FSDPBlock"] * 4
    else:
        assert compiled == [applied]
    assert [n.replace("_fsdp_wrapped_module.", "") for n, _ in applied.named_parameters()] == names


@pytest.mark.usefixtures("gpt_importable", "one_rank_group")
def test_apply_converts_the_block_linears_to_float8_and_trains() -> None:
    """The blocks' linear layers become torchao's Float8Linear; the head stays bf16. torch runs
    float8 matmuls on the CPU (emulated), so the step runs here too."""
    pytest.importorskip("torchao.float8", reason="torchao (the float8 extra) is not installed")
    import gpt
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear

    from autoshard.sharding import make_optimizer
    from tests.test_emit import candidate, make_rec

    c = candidate(engine=Engine.FSDP2, float8=True)
    model = gpt.build("tiny")
    chosen = float8_linears(model, c)
    assert len(chosen) == 4 * 5  # q, kv, o, up, down in each of 4 blocks
    with pytest.warns(HandoverNotice, match="precompute_float8_dynamic_scale_for_fsdp"):
        applied = make_rec(c).apply(model)
    converted = {n for n, m in applied.named_modules() if isinstance(m, Float8Linear)}
    assert len(converted) == 20 and all(n.startswith("blocks.") for n in converted)
    assert type(applied.lm_head) is nn.Linear
    optimizer = make_optimizer(applied.parameters(), c)
    with torch.autocast("cpu", torch.bfloat16):
        loss = applied(torch.randint(0, 4096, (2, 32))).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    precompute_float8_dynamic_scale_for_fsdp(applied)
    assert torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------
# A real compiled trial
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_compiled_trial_trains_on_two_gloo_processes(tmp_path: Path) -> None:
    """Two CPU processes compile each FSDP2 unit with inductor and train: the loss is finite
    and the trial is timed after the compiling steps."""
    from autoshard.target.resolve import TargetSpec
    from autoshard.trials.group import WorkerGroup

    target = TargetSpec(spec=f"{TARGETS}/stack.py:build", kwargs={"width": 32, "depth": 2})
    c = Candidate(
        engine=Engine.FSDP2, wrap_classes=("torch.nn.modules.linear.Linear",),
        precision="32-true", compile=True,
    )  # fmt: skip
    start = time.monotonic()
    with WorkerGroup(target, TuneOptions(nproc=2, trial_timeout=240), log_dir=tmp_path) as group:
        result = group.run(c, WorkloadSpec(), options=TuneOptions(warmup=1, steps=2, max_steps=2))
    assert result.status is TrialStatus.OK, result.error
    assert result.losses and all(torch.isfinite(torch.tensor(result.losses)))
    print(f"compiled trial: {time.monotonic() - start:.1f} s")


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
