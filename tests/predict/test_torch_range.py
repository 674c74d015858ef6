"""The profiles and predictions hold on every torch pyproject allows, not only CI's.

The GPU machines run torch 2.11 (../shared/gpu-runs/2026-11-28-h200): there every float8
prediction raised ("zip() argument 2 is longer than argument 1", recipe.py) and compile was
predicted equal to eager, because 2.11's FLOP formulas refuse grouped-query attention and the
whole FLOP profile fell back to 6 x parameters x tokens, which counts no traffic. Here: the
fallback profile predicted without raising (2.11's formula standing in on this torch:
tests/predict/test_flop_counting.py), and, where an interpreter with the oldest torch is
given (``AUTOSHARD_OLD_TORCH_PYTHON``, scripts/torch_tier.sh sets it up; CI runs it), the same
predictions on both torches within 1%."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from autoshard.child_env import child_env
from autoshard.config import Candidate, Engine, Hardware, WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]
OLD_TORCH = os.environ.get("AUTOSHARD_OLD_TORCH_PYTHON", "")
# CI's torch tier sets this: there a missing interpreter is a failure, not a skip
REQUIRED = os.environ.get("AUTOSHARD_REQUIRE_OLD_TORCH") == "1"


def _speed(flops: Any, profile: Any, **fields: Any) -> float:
    from autoshard.predict.speed import predict_speed

    candidate = Candidate(engine=Engine.FSDP2, wrap_classes=profile.wrap_policy, **fields)
    hardware = Hardware(gpus_per_node=1, gpu_memory=141 * 2**30, gpu="h200")
    return predict_speed(profile, flops, candidate, hardware, WorkloadSpec(seq_len=128)).step_time_s


def test_a_profile_without_traffic_predicts_float8_and_compile() -> None:
    """The rule-of-thumb profile (a forward that did not run on fake tensors) has FLOPs per
    block and no traffic: float8 and compile + float8 are predicted, not raised."""
    from autoshard import analyze_model
    from autoshard.predict.flops import six_n_t
    from examples.gpt import GPT

    with torch.device("meta"):
        model = GPT(n_layer=2, n_head=8, n_kv_head=2, d_model=256, ffn_hidden=512,
                    vocab_size=512, mlp="swiglu", max_seq_len=128)  # fmt: skip
    profile = analyze_model(model)
    flops = six_n_t(profile, WorkloadSpec(seq_len=128), "a stand-in")
    assert not flops.measured and flops.block_forward_traffic == ()
    eager = _speed(flops, profile)
    float8 = _speed(flops, profile, float8=True)
    both = _speed(flops, profile, float8=True, compile=True)
    assert float8 > 0 and both > 0
    assert float8 != eager  # the fp8 rate and the casts are in it


# ---------------------------------------------------------------------------------------------
# The oldest torch, beside this one
# ---------------------------------------------------------------------------------------------

PREDICT = """
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
from tests.predict.test_torch_range import predictions
print(json.dumps(predictions()))
"""


def predictions() -> dict[str, Any]:
    """The issue's call (``autoshard estimate examples/gpt.py:build --arg size=1b --gpus 1
    --gpu h200 --seq-len 2048 --engine fsdp2``): eager, compile, float8 and both, one
    configuration, with the FLOP profile they come from; and a tiny GPT's, whose attention
    has as many key/value heads as query heads."""
    import torch

    from autoshard import TargetSpec, analyze_target
    from autoshard.predict.flops import profile_flops
    from autoshard.predict.recipe import linear_shapes
    from autoshard.predict.speed import predict_speed

    out: dict[str, Any] = {"torch": torch.__version__}
    for size, seq in (("1b", 2048), ("tiny", 128)):
        profile, built = analyze_target(
            TargetSpec(spec=f"{ROOT}/examples/gpt.py:build", kwargs={"size": size})
        )
        workload = WorkloadSpec(seq_len=seq)
        flops = profile_flops(built.model, profile, workload)
        linears = linear_shapes(built.model, profile)
        hardware = Hardware(gpus_per_node=1, gpu_memory=141 * 2**30, gpu="h200")
        steps = {}
        for name, fields in (("eager", {}), ("compile", {"compile": True}),
                             ("float8", {"float8": True}),
                             ("both", {"compile": True, "float8": True})):  # fmt: skip
            c = Candidate(engine=Engine.FSDP2, wrap_classes=profile.wrap_policy,
                          checkpointing="all", checkpoint_classes=profile.checkpoint_policy,
                          micro_batch_size=2, **fields)  # fmt: skip
            speed = predict_speed(profile, flops, c, hardware, workload, linears=linears)
            steps[name] = speed.step_time_s
        out[size] = {"steps": steps, "flops": flops.model_dump(mode="json")}
    return out


@pytest.mark.slow
@pytest.mark.skipif(not OLD_TORCH and not REQUIRED, reason="no AUTOSHARD_OLD_TORCH_PYTHON")
def test_predictions_on_the_oldest_torch_match_this_ones() -> None:
    assert OLD_TORCH and Path(OLD_TORCH).exists(), (
        "AUTOSHARD_REQUIRE_OLD_TORCH=1 but no interpreter in AUTOSHARD_OLD_TORCH_PYTHON "
        f"({OLD_TORCH!r}): scripts/torch_tier.sh install"
    )
    done = subprocess.run(
        [OLD_TORCH, "-c", PREDICT, str(ROOT)], capture_output=True, text=True, timeout=600,
        cwd=ROOT, env=child_env(ROOT),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    old = json.loads(done.stdout.strip().splitlines()[-1])
    new = predictions()
    assert old["torch"].split("+")[0] != new["torch"].split("+")[0], (old["torch"], new["torch"])
    for size in ("1b", "tiny"):
        assert old[size]["flops"]["measured"], old[size]["flops"]["note"]
        for name, step in new[size]["steps"].items():
            assert old[size]["steps"][name] == pytest.approx(step, rel=0.01), (size, name)
        # compile and float8 change the step on both (not eager's, as on 2.11 before); at 1B
        # compile is faster; the tiny one is host-bound, where a compiled step's own host cost
        # (host_bound.COMPILED_STEP_HOST_S) can outweigh what its fusion saves
        steps = old[size]["steps"]
        assert steps["compile"] != steps["eager"] and steps["float8"] != steps["eager"], size
        assert size != "1b" or steps["compile"] < steps["eager"], size


def test_pyprojects_torch_range_is_the_range_ci_tests() -> None:
    """pyproject's lower bound is the torch the tier tests (scripts/torch_tier.sh), its upper
    bound excludes the minor after the one setup.sh installs for the suite."""
    import re

    import tomllib
    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    tier = re.search(r"^TORCH=torch==([\d.]+)$", (ROOT / "scripts/torch_tier.sh").read_text(), re.M)
    suite = re.search(r"torch==([\d.]+)\}", (ROOT / "scripts/setup.sh").read_text())
    assert tier and suite
    oldest, newest = Version(tier.group(1)), Version(suite.group(1))
    assert oldest in torch_req.specifier and newest in torch_req.specifier
    assert Version(f"{oldest.major}.{oldest.minor - 1}.99") not in torch_req.specifier
    assert Version(f"{newest.major}.{newest.minor + 1}.0") not in torch_req.specifier
