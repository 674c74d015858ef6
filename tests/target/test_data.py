"""The user's data: a DataLoader, a LightningDataModule, an iterable of batches, or a
LightningModule's own ``train_dataloader()`` gives the batches that trials, the activation
profile and the FLOP count run on (tests/targets/data_targets.py)."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.errors import TargetError
from autoshard.target.adapters import LightningStep, to_target
from autoshard.target.resolve import build_target
from autoshard.target.step import forward, make_batch, resize_batch

pytest.importorskip("lightning")

from ..targets import data_targets as dt

FILE = Path(dt.__file__).resolve()
LOADER = f"{FILE}:token_loader"
IMAGES = f"{FILE}:image_datamodule"
OWN = f"{FILE}:own_loader"
PLAN = {"gpus": 2, "gpu_memory": "8GiB"}


def _plan_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, autoshard.PlanWarning)]


def _estimate(spec, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        estimates = autoshard.estimate(spec, **{**PLAN, **options})
    return estimates, _plan_warnings(caught)


def _expected(samples: list[int]) -> dict[str, torch.Tensor]:
    data = dt.Sentences()
    return dt.pad_collate([data[i] for i in samples])


def test_a_loader_is_rebatched_to_each_micro_batch():
    built = build_target(to_target(LOADER))
    assert built.built_on == "meta" and not built.data.fixed
    first = _expected([0, 1])
    assert all(torch.equal(built.batch[k], first[k]) for k in first)  # real, not meta
    # micro-batch 3: the dataset's first three samples, padded together; not the first batch's
    # two rows repeated, whose padding and tokens differ
    three = built.data.batch(3)
    expected = _expected([0, 1, 2])
    assert all(torch.equal(three[k], expected[k]) for k in expected)
    assert not torch.equal(three["input_ids"], resize_batch(first, 3)["input_ids"])
    made = make_batch(built.model, built.batch, micro_batch_size=3, seq_len=None,
                      device=torch.device("cpu"), data=built.data)  # fmt: skip
    assert torch.equal(made["labels"], expected["labels"])
    assert (made["labels"] == dt.IGNORE).any()  # the padding is masked out of the loss


def test_the_plan_takes_the_loaders_sizes():
    estimates, said = _estimate(LOADER)
    plan = estimates.plan
    assert {e.candidate.micro_batch_size for e in estimates} == {2}  # the loader's batch_size
    assert plan.workload.seq_len == _expected([0, 1])["input_ids"].shape[1]
    assert not any("micro-batch" in w for w in said)
    estimates, _ = _estimate(LOADER, batch_size="1,4")
    assert {e.candidate.micro_batch_size for e in estimates} == {1, 4}


@pytest.mark.parametrize("target", ["token_loader", "token_generator"])
def test_a_fixed_batch_size_is_used_and_said_once(target):
    kwargs = {"fixed": True} if target == "token_loader" else {}
    estimates, said = _estimate(f"{FILE}:{target}", kwargs=kwargs, batch_size="1,2")
    assert {e.candidate.micro_batch_size for e in estimates} == {3}
    fixed = [w for w in said if w.startswith("micro-batch 3, not --batch-size 1,2: ")]
    assert len(fixed) == 1 and "makes its batches itself" in fixed[0]
    built = estimates.plan.built
    assert torch.equal(built.data.batch(3)["input_ids"], _expected([0, 1, 2])["input_ids"])


def test_profile_and_flops_run_on_the_loaders_shapes():
    small, _ = _estimate(IMAGES, kwargs={"size": 16})
    large, _ = _estimate(IMAGES, kwargs={"size": 32})
    for est in (small, large):  # both ran on fake tensors of the DataModule's batches
        assert est.plan.activations.note == "" and est.plan.speed.flops.note == ""
    acts = large.plan.activations.block_bytes[0] / small.plan.activations.block_bytes[0]
    flops = large.plan.speed.flops.block_forward[0] / small.plan.speed.flops.block_forward[0]
    assert acts == pytest.approx(4, rel=0.05) and flops == pytest.approx(4, rel=0.05)  # 2x side
    # the token loader's padded length sets the sequence the FLOPs count at
    tokens, _ = _estimate(LOADER)
    padded = _expected([0, 1])["input_ids"].shape[1]
    assert tokens.plan.speed.flops.note == ""
    assert tokens.plan.workload.seq_len == padded


def test_a_datamodule_is_set_up_as_the_trainer_would():
    built = build_target(to_target(IMAGES))
    assert isinstance(built.model, LightningStep)  # trained through its training_step
    assert set(built.batch) == {"image", "label"} and built.batch["image"].shape == (4, 3, 16, 16)


def test_a_lightning_modules_own_loader_is_its_data():
    spec = to_target(OWN)
    torch.manual_seed(0)
    built = build_target(spec, device="cpu")
    assert isinstance(built.model, LightningStep)
    assert built.data.origin == "OwnLoader.train_dataloader()"
    assert built.batch["image"].shape == (2, 3, 16, 16)  # its loader's batch_size
    loss = forward(built.model, built.data.batch(3))  # training_step on the batch's keys
    assert loss.dim() == 0 and torch.isfinite(loss)
    # as an object too: saved for the workers, who make its loader again
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = autoshard.recommend(dt.own_loader(), out_dir=tempfile.mkdtemp(), **PLAN)
    assert rec.chosen.candidate.micro_batch_size == 2


def test_a_loader_given_as_batch():
    model, loader = dt.token_loader()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimates = autoshard.estimate(model, batch=loader, **PLAN)
    assert estimates.plan.workload.seq_len == _expected([0, 1])["input_ids"].shape[1]


def test_tensors_made_on_meta_are_one_line(cli):
    with pytest.raises(TargetError, match="yields meta tensors: they were made while the factory"):
        build_target(to_target(f"{FILE}:eager_tensors"))
    code, _, err = cli("estimate", f"{FILE}:eager_tensors", "--gpus", "2", "--gpu-memory", "8GiB")
    assert code == 1 and err.count("error:") == 1 and "Traceback" not in err


def _first_loss(spec: str, samples: int) -> float:
    """The first loss a trial computes: the model as a trial initialises it, on the loader's
    batch of ``samples``."""
    import sys

    from autoshard.target.resolve import load_callable
    from autoshard.target.step import compute_loss, find_loss_fn, with_labels

    target = to_target(spec)
    torch.manual_seed(0)
    built = build_target(target, device="cpu")
    batch = with_labels(built.model, built.data.batch(samples))
    # the loss a worker takes: the target module's autoshard_loss, if any (the token loader's)
    loss_fn = find_loss_fn(sys.modules.get(load_callable(target.spec).__module__))
    return float(compute_loss(forward(built.model, batch), batch, loss_fn).detach())


@pytest.mark.slow
@pytest.mark.parametrize("spec", [LOADER, IMAGES], ids=["dataloader", "datamodule"])
def test_trials_train_on_the_loaders_batches(spec, tmp_path):
    """2 gloo processes: the first loss of a trial is the one of the loader's batch of 3 (padded
    token dicts with a label mask; a DataModule's image dicts that only its loader yields)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = autoshard.tune(spec, gpu_memory="2GiB", batch_size=3, precision="32-true",
                             trials=1, warmup=1, steps=2, out_dir=str(tmp_path))  # fmt: skip
    trial = rec.chosen.trial
    assert trial.status.value == "ok" and trial.world_size == 2
    assert trial.losses[0] == pytest.approx(_first_loss(spec, 3), abs=1e-4)
