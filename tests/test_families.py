"""Real model families through the public API: Hugging Face Llama, GPT-2 (tied), T5
(encoder-decoder), ViT (images), a LightningModule with configure_model, and the seed guide's
Transformer demo. Configurations come from configs: no weights are downloaded.

Fast tests plan with the estimator (trials=0); slow ones run one real FSDP trial per family on
2 gloo processes and check that it trains (finite loss, which falls over the steps)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

from autoshard.api import recommend
from autoshard.results import TrialStatus
from autoshard.target.adapters import LightningStep
from autoshard.target.resolve import _import_file

from .conftest import EXAMPLES, ROOT

pytestmark = pytest.mark.filterwarnings("ignore::autoshard.PlanWarning")

HF = "transformers.models"
FAMILIES = {
    "hf_llama": (f"{HF}.llama.modeling_llama.LlamaDecoderLayer",),
    "hf_gpt2": (f"{HF}.gpt2.modeling_gpt2.GPT2Block",),
    "hf_t5": (f"{HF}.t5.modeling_t5.T5Block",),
    "hf_vit": (f"{HF}.vit.modeling_vit.ViTEmbeddings", f"{HF}.vit.modeling_vit.ViTLayer"),
    "lightning_module": (
        "torch.nn.modules.transformer.TransformerDecoderLayer",
        "torch.nn.modules.transformer.TransformerEncoderLayer",
    ),
    "lightning_transformer": (
        "torch.nn.modules.transformer.TransformerDecoderLayer",
        "torch.nn.modules.transformer.TransformerEncoderLayer",
    ),
}


def _needs(family: str) -> None:
    pytest.importorskip("transformers" if family.startswith("hf_") else "lightning")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_estimate(family: str) -> None:
    _needs(family)
    rec = recommend(f"{EXAMPLES}/{family}.py:build", gpus=8, gpu_memory="80GiB")
    # The analyzer's block class is the wrap policy every per-block candidate uses (for these
    # tiny sizes the step-time model may prefer the whole model as one unit: fewer collectives).
    assert set(rec.profile.wrap_policy) == set(FAMILIES[family])
    assert set(rec.chosen.candidate.wrap_classes) in (set(), set(FAMILIES[family]))
    if family.startswith("hf_"):
        # the blocks come from the model's own _no_split_modules
        assert {c.rpartition(".")[2] for c in FAMILIES[family]} <= set(rec.profile.no_split_modules)
    assert rec.chosen.estimate is not None and rec.chosen.estimate.fits
    assert rec.workload.micro_batch_size == 2  # the example batch's
    assert len(rec.reasons) >= 8


def test_gpt2_tied_embeddings() -> None:
    pytest.importorskip("transformers")
    rec = recommend(f"{EXAMPLES}/hf_gpt2.py:build", gpus=8, gpu_memory="80GiB")
    (group,) = rec.profile.tied
    assert set(group.names) == {"transformer.wte.weight", "lm_head.weight"}
    assert any(r.startswith("tied parameters") for r in rec.reasons)


def test_hf_model_object_is_rebuilt_from_its_config(tmp_path) -> None:
    """A model object in memory: workers rebuild it from its config (no weights written)."""
    pytest.importorskip("transformers")
    from autoshard.target.adapters import to_target

    model, batch = _import_file(str(EXAMPLES / "hf_t5.py")).build()
    spec = to_target(model, batch=batch, out_dir=tmp_path)
    assert spec.spec == "autoshard.target.adapters:with_saved_batch"
    assert spec.kwargs["target"] == "autoshard.target.adapters:build_hf_from_config"
    assert not list(tmp_path.glob("model-*.pt"))
    rec = recommend(model, batch=batch, gpus=8, gpu_memory="80GiB", out_dir=tmp_path)
    assert rec.profile.total_params == sum(p.numel() for p in model.parameters())
    assert rec.profile.wrap_policy == FAMILIES["hf_t5"]


def test_lightning_module_object_trains_through_training_step(tmp_path) -> None:
    pytest.importorskip("lightning")
    from autoshard.target.adapters import to_target
    from autoshard.target.resolve import build_target

    module, batch = _import_file(str(EXAMPLES / "lightning_module.py")).build()
    assert module.model is None  # layers come from configure_model
    spec = to_target(module, batch=batch, out_dir=tmp_path)
    built = build_target(spec, device="cpu")
    assert isinstance(built.model, LightningStep)
    loss = built.model(*built.batch)  # what a trial runs: the user's training_step
    assert loss.dim() == 0 and math.isclose(
        loss.item() if not loss.requires_grad else loss.detach().item(),
        math.log(33278),
        rel_tol=0.1,
    )


# ---------------------------------------------------------------------------------------------
# One real trial per family (2 gloo processes), ~15-25 s each
# ---------------------------------------------------------------------------------------------


def _check_trained(rec) -> None:
    trial = rec.chosen.trial
    assert rec.basis == "trials"
    assert trial is not None and trial.status is TrialStatus.OK, trial and trial.error
    assert trial.world_size == 2
    assert all(math.isfinite(v) for v in trial.losses)
    assert trial.losses[-1] < trial.losses[0]


def _one_trial(model, tmp_path, **kwargs):
    return recommend(
        model, gpus=2, gpu_memory="8GiB", trials=1, precision="32-true", out_dir=tmp_path,
        nproc=2, trial_timeout=120, warmup=1, steps=2, **kwargs,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["hf_llama", "hf_t5", "hf_vit", "lightning_transformer"])
def test_family_trial(family: str, tmp_path) -> None:
    _needs(family)
    _check_trained(_one_trial(f"{EXAMPLES}/{family}.py:build", tmp_path))


@pytest.mark.slow
def test_hf_gpt2_object_trial(tmp_path) -> None:
    """A Hugging Face model object with tied embeddings, rebuilt from its config in workers."""
    pytest.importorskip("transformers")
    model, batch = _import_file(str(EXAMPLES / "hf_gpt2.py")).build()
    _check_trained(_one_trial(model, tmp_path, batch=batch))


@pytest.mark.slow
def test_lightning_module_object_trial(tmp_path) -> None:
    """A LightningModule object: meta copy saved, configure_model, its training_step's loss."""
    pytest.importorskip("lightning")
    module, batch = _import_file(str(EXAMPLES / "lightning_module.py")).build()
    _check_trained(_one_trial(module, tmp_path, batch=batch))


@pytest.mark.slow
def test_module_defined_in_main_script_trial(tmp_path) -> None:
    """A model class defined in a script run as __main__: the workers import the script."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import warnings
            import torch
            from torch import nn
            import autoshard.api

            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.blocks = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
                    self.head = nn.Linear(64, 10)

                def forward(self, x, y):
                    return nn.functional.cross_entropy(self.head(self.blocks(x)), y)

            if __name__ == "__main__":
                warnings.simplefilter("ignore")
                batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
                rec = autoshard.api.recommend(
                    Net(), batch=batch, gpus=2, gpu_memory="8GiB", trials=1,
                    precision="32-true", out_dir={str(tmp_path / "out")!r}, nproc=2,
                    trial_timeout=120, warmup=1, steps=2)
                t = rec.chosen.trial
                print("RESULT", t.status.value, t.losses[0] > t.losses[-1], t.error)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=ROOT
    )
    assert "RESULT ok True None" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
