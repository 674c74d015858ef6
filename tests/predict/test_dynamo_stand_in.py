"""The profiles without ``torch._dynamo`` (:func:`autoshard.predict.dynamo_stand_in.without_dynamo`): the
same numbers as with it, dynamo left unloaded, and dynamo whole again afterwards.

Dynamo is loaded once per process, so each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from torch import nn

from autoshard import WorkloadSpec, analyze_model, profile_activations
from autoshard.child_env import child_env
from autoshard.predict import fakes
from autoshard.predict.flops import profile_flops
from tests.conftest import ROOT


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; the JSON it prints last."""
    env = child_env(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_PROFILES = """
import json, sys, torch
from autoshard import TargetSpec, WorkloadSpec, analyze_target, profile_activations
from autoshard.plan import compile_supported
from autoshard.predict.flops import profile_flops
{model}
def profiles():
    acts = profile_activations(model, profile, work, batch=batch,
                               precisions=("bf16-mixed", "32-true"))
    flops = profile_flops(model, profile, work, batch=batch)
    return [acts.model_dump(mode="json"), flops.model_dump(mode="json")]
supported = compile_supported()
without = profiles()
def double(x):
    return 2 * x
wrapped = torch._disable_dynamo(double)  # as torch wraps its Python meta kernels
from autoshard.predict.dynamo_stand_in import without_dynamo
reset = without_dynamo(wrapped, 3) == 6 and not hasattr(double, "__dynamo_disable")
loaded = sorted(m for m in sys.modules if m.startswith("torch._dynamo"))
import torch._dynamo  # the real one, whole: the profiles then run with it
with_dynamo = profiles()
wrapped(3)
redisabled = getattr(double, "__dynamo_disable", double) is not double
compiled = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2, backend="eager")
x = torch.randn(3)
print(json.dumps({{"without": without, "with": with_dynamo, "loaded": loaded,
    "compiled": bool(torch.equal(compiled(x), torch.nn.functional.gelu(x) * 2)),
    "supported": supported, "reset": reset, "redisabled": redisabled}}))
"""

_GPT = """
profile, built = analyze_target(TargetSpec(spec="examples/gpt.py:build",
                                           kwargs={"size": "tiny", "n_layer": 2}))
model, batch, work = built.model, built.batch, WorkloadSpec(seq_len=64)
"""

# A forward that makes a real tensor (torch.tensor of a list): the fake mode converts it, and its
# converter needs torch._dynamo.source, which the stand-in does not give.
_CONVERTING = """
from torch import nn
from autoshard import analyze_model
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
    def forward(self, x):
        return self.fc(x) * torch.tensor([2.0] * 16)
with torch.device("meta"):
    model = nn.Sequential(Scaled(), Scaled())
profile, batch, work = analyze_model(model), torch.randn(2, 8, 16), WorkloadSpec()
"""


def test_profiles_without_dynamo_equal_those_with_it_and_leave_it_unloaded():
    out = _fresh(_PROFILES.format(model=_GPT))
    assert out["loaded"] == ["torch._dynamo.config"]  # the config alone, loaded for the fake mode
    assert out["without"] == out["with"]
    assert out["without"][0]["measured"] and out["without"][1]["measured"]
    assert out["supported"] is None  # asked without importing dynamo (loaded is config only)
    # the functions the stand-in left undisabled are disabled by the real dynamo afterwards
    assert out["reset"] and out["redisabled"] and out["compiled"]


def test_a_forward_that_needs_dynamo_is_profiled_again_with_it():
    out = _fresh(_PROFILES.format(model=_CONVERTING))
    assert "torch._dynamo.eval_frame" in out["loaded"]  # the rerun loaded the real one
    assert out["without"] == out["with"]
    assert out["without"][0]["measured"] and out["without"][1]["measured"]
    assert out["compiled"]


def test_a_torch_without_dynamo_s_config_file_profiles_with_the_real_one():
    code = _PROFILES.format(model=_GPT).replace(
        "supported = compile_supported()",
        "import autoshard.predict.dynamo_stand_in as stand_in\n"
        "def missing(locations):\n"
        "    raise ImportError('no config')\n"
        "stand_in._dynamo_config = missing\n"
        "supported = compile_supported()",
    )
    out = _fresh(code)
    assert out["without"] == out["with"]
    assert out["without"][0]["measured"] and out["without"][1]["measured"]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * scale[..., :1]


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, ids: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                again: torch.Tensor) -> torch.Tensor:  # fmt: skip
        x = self.emb(ids) + self.emb(again)
        for block in self.blocks:
            x = block(x, scale)
        return x[:, 1:] * weight


def test_batch_fakes_made_afresh_profile_as_the_converter_s(monkeypatch):
    """convert_afresh gives the fake mode the tensors its converter would make: the same profile
    (a token batch, a float batch, a one-element tensor the mode keeps the value of, and one
    tensor twice)."""
    with torch.device("meta"):
        model = _Model()
    ids = torch.randint(0, 64, (1, 8))
    scale = torch.rand(1, 8, 32)
    batch = {"ids": ids, "scale": scale, "weight": torch.tensor(0.5), "again": ids}
    profile, work = analyze_model(model), WorkloadSpec()

    def profiles() -> tuple:
        acts = profile_activations(model, profile, work, batch=batch)
        return acts.model_dump(), profile_flops(model, profile, work, batch=batch).model_dump()

    made = fakes.fake_model(model, profile.checkpoint_policy, batch)
    assert len(made.held) == 2  # ids (once) and scale; the one-element weight is converted
    afresh = profiles()
    monkeypatch.setattr(fakes, "convert_afresh", lambda mode, batch: [])
    assert profiles() == afresh
    assert afresh[0]["measured"] and afresh[1]["measured"]


def test_compile_support_is_torch_compile_s_own_check(monkeypatch):
    from autoshard.plan import compile_supported

    assert compile_supported() is None

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("torch.compile is not supported on Python 3.15+")

    monkeypatch.setattr(torch, "compile", refuse)
    assert "not supported on Python 3.15+" in (compile_supported() or "")


def test_the_cli_freezes_import_time_objects(monkeypatch):
    import gc

    from autoshard import cli

    monkeypatch.setattr(cli, "app", lambda: None)
    gc.unfreeze()
    try:
        cli.main()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
