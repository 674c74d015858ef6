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
from autoshard.cli import app
from autoshard.config import Candidate, Engine, Precision, WorkloadSpec
from autoshard.errors import ConfigError, HandoverNotice
from autoshard.gpus import CATALOGUE
from autoshard.options import TuneOptions
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


def test_pinned_compile_and_float8_plan_them_and_only_them() -> None:
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
    # both are modelled (predict/recipe.py): no line says their effect is not
    assert not any("not modelled" in line for line in lines)


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
    from autoshard.options import PlanOptions
    from autoshard.plan import planned_switches

    options = PlanOptions(engine="fsdp2")
    for gpu_id, spec in CATALOGUE.items():
        if gpu_id == "cpu-gloo":
            continue
        hardware = Hardware(gpus_per_node=8, gpu_memory=spec.memory, gpu=gpu_id)
        compiles, float8s, _ = planned_switches(options, hardware)
        assert (True in float8s) == bool(spec.fp8_flops), gpu_id
        assert compiles == (False, True), gpu_id


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
