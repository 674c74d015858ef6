"""What autoshard hands over, taken into its real consumers: ``rec.apply(model)`` for plain
torch, Lightning's Trainer (through LightningCLI and the exported YAML) and Fabric train for real
on 2 gloo processes; the consumers that refuse FSDP on CPU (Lightning's and Fabric's
``FSDPStrategy``, the Hugging Face Trainer's ``TrainingArguments``) are constructed from the
output and compared with the recommendation field by field.

This file is also the worker script: the slow test runs it under ``torch.distributed.run``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from autoshard.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS = 3

# ---------------------------------------------------------------------------------------------
# The worker: each check builds examples/gpt.py's tiny GPT and hands it to one consumer
# ---------------------------------------------------------------------------------------------


def batch_for(rec: Any) -> Any:
    import torch

    seq = rec.workload.seq_len or 64
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 4096, (rec.chosen.candidate.micro_batch_size, seq + 1), generator=gen)


def this_device() -> Any:
    """The device this rank computes on (the CUDA device the process group's rank uses)."""
    import torch

    cuda = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def gpt_loss(model: Any, idx: Any) -> Any:
    import torch.nn.functional as F

    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def structure(model: Any) -> dict[str, Any]:
    """What was applied: FSDP units, which blocks (by index) are checkpointed, and the dtypes the
    first block's first linear layer computes in (its weight and input during forward)."""
    import gpt
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    blocks = [m for m in model.modules() if isinstance(m, gpt.Block)]
    wrapped = {
        id(m._checkpoint_wrapped_module)
        for m in model.modules()
        if isinstance(m, CheckpointWrapper)
    }
    seen: dict[str, str] = {}

    def record(module: Any, args: Any) -> None:
        seen.setdefault("weight", str(module.weight.dtype))
        seen.setdefault("input", str(args[0].dtype))

    blocks[0].mlp.up.register_forward_pre_hook(record)
    return {
        "fsdp1 units": sum(isinstance(m, FSDP) for m in model.modules()),
        "fsdp2 units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "checkpointed blocks": [i for i, b in enumerate(blocks) if id(b) in wrapped],
        "compute": seen,
    }


def local_values(model: Any) -> Any:
    import torch
    from torch.distributed.tensor import DTensor

    parts = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().float().reshape(-1) for p in parts]).clone()


def saved_bytes(model: Any, rec: Any, idx: Any) -> int:
    """Bytes autograd keeps for backward in one forward and loss (unique storages): what
    activation checkpointing removes."""
    import torch

    storages: dict[int, int] = {}

    def pack(t: Any) -> Any:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec.autocast():
        loss = gpt_loss(model, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def check_apply(path: str) -> dict[str, Any]:
    """``rec.apply(model)`` exactly as the README says, then the user's loop: 3 steps."""
    import gpt
    import torch

    import autoshard

    rec = autoshard.load(path)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = rec.apply(gpt.build("tiny"))
    out = structure(model)
    out["notice"] = [str(w.message) for w in caught if w.category is autoshard.HandoverNotice]
    out["mesh"] = [
        list(p.device_mesh.shape) for p in model.parameters() if hasattr(p, "device_mesh")
    ][:1]
    idx = batch_for(rec).to(this_device())
    out["saved bytes"] = saved_bytes(model, rec, idx)
    out["params on"] = sorted({p.device.type for p in model.parameters()})
    before = local_values(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(STEPS):
        with rec.autocast():
            loss = gpt_loss(model, idx)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["losses"] = losses
    out["params changed"] = bool((local_values(model) - before).abs().max() > 0)
    return out


def check_fabric(path: str) -> dict[str, Any]:
    """Lightning Fabric with ``rec.strategy(fabric=True)``: setup, then 3 steps."""
    import gpt
    import torch
    from lightning.fabric import Fabric

    import autoshard

    rec = autoshard.load(path)
    fabric = Fabric(strategy=rec.strategy(fabric=True), **rec.trainer_kwargs())  # type: ignore[arg-type]
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(gpt.build("tiny"))
    out = structure(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    idx = fabric.to_device(batch_for(rec))
    before = local_values(model)
    losses = []
    for _ in range(STEPS):
        loss = gpt_loss(model, idx)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["losses"] = losses
    out["params changed"] = bool((local_values(model) - before).abs().max() > 0)
    out["strategy"] = type(fabric.strategy).__name__
    return out


def check_lightning_cli(yaml_path: str, rec_path: str) -> dict[str, Any]:
    """The exported YAML as a LightningCLI script takes it (``fit --config``), with the
    LightningModule's ``configure_model`` following the YAML's comment: ``autoshard.load``."""
    import gpt
    import lightning as L
    import torch
    from lightning.pytorch.cli import LightningCLI

    import autoshard

    class LitGPT(L.LightningModule):
        def __init__(self, rec_path: str) -> None:
            super().__init__()
            self.rec_path = rec_path
            self.model: Any = None
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if self.model is not None:
                return
            torch.manual_seed(0)
            self.model = gpt.build("tiny")
            rec = autoshard.load(self.rec_path)  # as the YAML's comment says
            rec.fsdp2_plan()(self.model, self.device_mesh["data_parallel"])  # type: ignore[operator]
            self.applied = structure(self.model)

        def training_step(self, batch: Any, _: int) -> Any:
            loss = gpt_loss(self.model, batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

        def train_dataloader(self) -> Any:
            from torch.utils.data import DataLoader

            idx = batch_for(autoshard.load(self.rec_path))
            return DataLoader([idx] * STEPS, batch_size=None)

    cli = LightningCLI(
        LitGPT,
        args=[
            "fit", "--config", yaml_path, "--model.rec_path", rec_path,
            f"--trainer.max_steps={STEPS}", "--trainer.logger=false",
            "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.use_distributed_sampler=false",
        ],
        save_config_callback=None,
    )  # fmt: skip
    out = cli.model.applied
    out["losses"] = cli.model.losses
    out["strategy"] = type(cli.trainer.strategy).__name__
    out["precision"] = cli.trainer.precision
    return out


# What only a GPU machine runs (FSDP on CPU is refused by these consumers): each for real.


def check_trainer(path: str) -> dict[str, Any]:
    """Lightning's Trainer with ``rec.strategy()`` (FSDPStrategy): fit 3 steps."""
    import gpt
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import autoshard

    rec = autoshard.load(path)

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = gpt.build("tiny")
            self.losses: list[float] = []

        def on_train_start(self) -> None:
            self.applied = structure(self.trainer.strategy.model)

        def training_step(self, batch: Any, _: int) -> Any:
            loss = gpt_loss(self.model, batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    lit = LitGPT()
    trainer = L.Trainer(
        strategy=rec.strategy(), **rec.trainer_kwargs(), max_steps=STEPS, logger=False,  # type: ignore[arg-type]
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(lit, DataLoader([batch_for(rec)] * STEPS, batch_size=None))
    return {**lit.applied, "losses": lit.losses, "strategy": type(trainer.strategy).__name__}


def check_accelerate(yaml_path: str, rec_path: str) -> dict[str, Any]:
    """accelerate with the exported YAML, read as ``accelerate launch --config_file`` reads it
    (the workers' environment), then ``Accelerator().prepare``: 3 steps."""
    import gpt
    import torch
    from accelerate import Accelerator
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    import autoshard

    args = launch_command_parser().parse_args(["--config_file", yaml_path, "train.py"])
    _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    os.environ.update(
        {k: v for k, v in env.items() if k.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_"))}
    )
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = gpt.build("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = accelerator.prepare(model, opt)
    out = structure(model)
    idx = batch_for(autoshard.load(rec_path)).to(accelerator.device)
    before = local_values(model)
    losses = []
    for _ in range(STEPS):
        with accelerator.autocast():
            loss = gpt_loss(model, idx)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["losses"] = losses
    out["params changed"] = bool((local_values(model) - before).abs().max() > 0)
    return out


def check_hf_trainer(path: str, output_dir: str) -> dict[str, Any]:
    """The Hugging Face Trainer with ``TrainingArguments(**rec.trainer_arguments())``: train 3
    steps of the tiny GPT (returning its loss as a Hugging Face model does)."""
    import gpt
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers import Trainer, TrainingArguments

    import autoshard

    rec = autoshard.load(path)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = gpt.build("tiny")

        def forward(self, input_ids: Any, labels: Any) -> dict[str, Any]:
            logits = self.gpt(input_ids)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            return {"loss": loss, "logits": logits}

    idx = batch_for(rec)
    data = [{"input_ids": row[:-1], "labels": row[1:]} for row in idx] * STEPS * 2
    torch.manual_seed(0)
    training = TrainingArguments(
        output_dir, max_steps=STEPS, report_to="none", save_strategy="no", logging_steps=1,
        **rec.trainer_arguments(),  # type: ignore[arg-type]
    )  # fmt: skip
    trainer = Trainer(model=LM(), args=training, train_dataset=data)  # type: ignore[arg-type]
    trainer.train()
    out = structure(trainer.model_wrapped)
    out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return out


def check_readme(script: str) -> dict[str, Any]:
    """The README's training script, run as written (it starts the process group itself)."""
    import autoshard

    namespace: dict[str, Any] = {"__name__": "__main__"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(Path(script).read_text(), script, "exec"), namespace)
    out = structure(namespace["model"])
    out["loss"] = namespace["loss"].item()
    out["notice"] = [str(w.message) for w in caught if w.category is autoshard.HandoverNotice]
    return out


def main() -> None:
    import torch
    import torch.distributed as dist

    from autoshard.trials.worker import exit_worker

    jobs = json.loads(Path(sys.argv[2]).read_text())
    out: dict[str, Any] = {}
    if "readme" in jobs:  # first: it initialises the process group as a user's script does
        out["readme"] = check_readme(jobs.pop("readme")[1])
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    checks = {
        "apply": check_apply, "fabric": check_fabric, "cli": check_lightning_cli,
        "trainer": check_trainer, "accelerate": check_accelerate, "hf": check_hf_trainer,
    }  # fmt: skip
    for name, (kind, *paths) in jobs.items():
        check = checks[kind]
        out[name] = check(*paths)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(out))
    exit_worker()  # not a plain exit: gloo can abort the interpreter's finalization


def run_two_ranks(tmp_path: Path, jobs: dict[str, list[str]], nproc: int = 2) -> dict[str, Any]:
    spec, result = tmp_path / "jobs.json", tmp_path / "result.json"
    spec.write_text(json.dumps(jobs))
    env = child_env(EXAMPLES, ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
         "--standalone", __file__, str(result), str(spec)],
        env=env, capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(result.read_text()))


# ---------------------------------------------------------------------------------------------
# The recommendations handed over
# ---------------------------------------------------------------------------------------------


def readme_script() -> str:
    """The README's whole training script (the python block that calls ``rec.apply``)."""
    text = (ROOT / "README.md").read_text()
    blocks = [b.split("```")[0] for b in text.split("```python\n")[1:]]
    (script,) = [b for b in blocks if "torchrun" in b and "rec.apply(" in b]
    return script


def only_with_checkpointing() -> tuple[Any, Any]:
    """A recommendation from the estimator that fits only because of checkpointing (tiny GPT,
    16 x 256 tokens per rank, 1.3 GiB GPUs: every candidate without checkpointing is predicted
    not to fit), and the estimate of the same configuration without checkpointing. torch.compile
    is pinned off: it would be the answer's twin (fitting as well, predicted faster)."""
    import autoshard
    from autoshard.config import Checkpointing

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoshard.PlanWarning)
        est = autoshard.estimate(
            f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"}, gpus=2, gpu_memory="1.3GiB",
            seq_len=256, batch_size=[16], precision=["bf16-mixed"], compile=False,
        )  # fmt: skip
    rec = est.recommendation
    assert rec is not None
    assert rec.chosen.candidate.checkpointing is Checkpointing.ALL
    plain = rec.chosen.candidate.model_copy(
        update={"checkpointing": Checkpointing.NONE, "checkpoint_classes": ()}
    )
    without = [e for e in est if e.candidate == plain]
    assert len(without) == 1 and not without[0].fits
    assert not [e for e in est if e.fits and e.candidate.checkpointing is Checkpointing.NONE]
    return autoshard.Recommendation.model_validate(rec.model_dump()), without[0]


def recs() -> dict[str, Any]:
    from autoshard.config import Checkpointing, Engine, Precision, Reshard, Sharding
    from tests.test_emit import candidate, make_rec

    bf16 = Precision.BF16_MIXED
    every2 = {"checkpointing": Checkpointing.EVERY_K, "checkpoint_every": 2}
    return {
        "fsdp1 every 2": make_rec(candidate(precision=bf16, **every2)),
        "fsdp2 hybrid ckpt": make_rec(
            candidate(
                engine=Engine.FSDP2,
                sharding=Sharding.HYBRID_SHARD,
                hybrid_mesh=(1, 2),
                precision=bf16,
                checkpointing=Checkpointing.ALL,
                reshard=Reshard.KEEP_ROOT,
            )
        ),
        "fsdp2 every 2": make_rec(candidate(engine=Engine.FSDP2, precision=bf16, **every2)),
    }


@pytest.mark.slow
def test_what_autoshard_hands_over_trains_on_two_gloo_processes(tmp_path: Path) -> None:
    """One launch, six checks: the README's script; rec.apply for FSDP1 (every 2nd block checkpointed) and FSDP2
    (HYBRID_SHARD mesh, every block), a recommendation that fits only with checkpointing,
    Fabric with the FSDP2 strategy, and LightningCLI with the exported YAML."""
    tight, without = only_with_checkpointing()
    paths: dict[str, str] = {}
    for name, rec in {**recs(), "fits only with ckpt": tight}.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        (folder / "recommendation.json").write_text(rec.to_yaml("json"))
        paths[name] = str(folder)
    yaml_path = tmp_path / "fsdp2.yaml"
    lightning_yaml = recs()["fsdp2 every 2"].to_yaml("lightning")
    assert 'rec = autoshard.load("autoshard-out")' in lightning_yaml
    yaml_path.write_text(lightning_yaml)
    # The README's script, next to the autoshard-out/ folder it loads.
    (tmp_path / "autoshard-out").mkdir()
    (tmp_path / "autoshard-out" / "recommendation.json").write_text(tight.to_yaml("json"))
    (tmp_path / "train.py").write_text(readme_script())
    jobs = {
        "readme": ["readme", str(tmp_path / "train.py")],
        "fsdp1 every 2": ["apply", paths["fsdp1 every 2"]],
        "fsdp2 hybrid ckpt": ["apply", paths["fsdp2 hybrid ckpt"]],
        "fits only with ckpt": ["apply", paths["fits only with ckpt"] + "/recommendation.json"],
        "fabric": ["fabric", paths["fsdp2 every 2"]],
        "lightning cli": ["cli", str(yaml_path), paths["fsdp2 every 2"]],
    }
    out = run_two_ranks(tmp_path, jobs)
    # Fits only with checkpointing: apply checkpoints every block, and what autograd keeps for
    # backward is what the estimate budgets, far below what the uncheckpointed model keeps.
    readme = out["readme"]
    assert readme["fsdp1 units"] == 5 and readme["checkpointed blocks"] == [0, 1, 2, 3]
    assert math.isfinite(readme["loss"]) and "ckpt mbs16" in readme["notice"][0]
    tight_out = out["fits only with ckpt"]
    budget = tight.chosen.estimate.breakdown.activations
    assert tight_out["saved bytes"] <= 1.1 * budget, (tight_out["saved bytes"], budget)
    assert without.breakdown.activations > 1.5 * tight_out["saved bytes"]
    assert tight_out["checkpointed blocks"] == [0, 1, 2, 3]
    bf16 = {"weight": "torch.bfloat16", "input": "torch.bfloat16"}
    one, two = out["fsdp1 every 2"], out["fsdp2 hybrid ckpt"]
    # 4 blocks + the root, one FSDP unit each; blocks 0 and 2 (one in two) or all checkpointed.
    assert (one["fsdp1 units"], one["checkpointed blocks"], one["compute"]) == (5, [0, 2], bf16)
    assert (two["fsdp2 units"], two["checkpointed blocks"], two["compute"]) == (
        5,
        [0, 1, 2, 3],
        bf16,
    )
    assert two["mesh"] == [[1, 2]]
    assert "on the CPU of each rank (gloo" in one["notice"][0]
    assert "fsdp1 FULL_SHARD bf16-mixed ckpt/2" in one["notice"][0]
    for name in ("fsdp1 every 2", "fsdp2 hybrid ckpt", "fits only with ckpt", "fabric"):
        assert all(math.isfinite(x) for x in out[name]["losses"]), name
        assert out[name]["params changed"] and len(out[name]["losses"]) == STEPS, name
    # Fabric and LightningCLI: ModelParallelStrategy, the plan applied on Fabric's / Lightning's
    # data-parallel mesh, one block in two checkpointed.
    fabric, cli = out["fabric"], out["lightning cli"]
    assert (fabric["strategy"], fabric["fsdp2 units"]) == ("ModelParallelStrategy", 5)
    assert fabric["checkpointed blocks"] == [0, 2] and fabric["compute"] == bf16
    assert (cli["strategy"], cli["fsdp2 units"], cli["precision"]) == (
        "ModelParallelStrategy", 5, "bf16-mixed",
    )  # fmt: skip
    assert cli["checkpointed blocks"] == [0, 2] and cli["compute"] == bf16
    assert len(cli["losses"]) == STEPS and all(math.isfinite(x) for x in cli["losses"])


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (FSDP on GPUs)")
def test_each_consumer_trains_on_the_gpus(tmp_path: Path) -> None:
    """On the GPUs here (NCCL, one process each): rec.apply with FSDP1 CPU offload (GPU-only)
    and with FSDP2; Lightning's Trainer with FSDPStrategy; Fabric with FSDPStrategy and
    ModelParallelStrategy; LightningCLI with the FSDP2 YAML; accelerate with its YAML; the
    Hugging Face Trainer with trainer_arguments(). benchmarks/gpu.sh handover runs it."""
    import torch

    from autoshard.config import Checkpointing, Engine, Hardware, Precision, Reshard
    from tests.test_emit import candidate, make_rec

    n = torch.cuda.device_count()
    hardware = Hardware(gpus_per_node=n, nodes=1, gpu_memory=torch.cuda.mem_get_info()[1])
    bf16 = Precision.BF16_MIXED
    every2 = {"checkpointing": Checkpointing.EVERY_K, "checkpoint_every": 2}
    ckpt = {"checkpointing": Checkpointing.ALL}
    recs = {
        "fsdp1 offload": candidate(precision=bf16, cpu_offload=True, **every2),
        "fsdp1 every 2": candidate(precision=bf16, **every2),
        "fsdp1 ckpt": candidate(precision=bf16, **ckpt),
        "fsdp2 every 2": candidate(engine=Engine.FSDP2, precision=bf16, **every2),
        "fsdp2 ckpt": candidate(
            engine=Engine.FSDP2, precision=bf16, reshard=Reshard.KEEP_ROOT_AND_LAST, **ckpt
        ),
    }
    paths = {}
    for name, c in recs.items():
        paths[name] = tmp_path / f"{name.replace(' ', '-')}.json"
        paths[name].write_text(make_rec(c, hardware=hardware).to_yaml("json"))
    lightning_yaml = tmp_path / "fsdp2.yaml"
    lightning_yaml.write_text(make_rec(recs["fsdp2 every 2"], hardware=hardware).to_yaml())
    accelerate_yaml = tmp_path / "accelerate.yaml"
    accelerate_yaml.write_text(
        make_rec(recs["fsdp1 ckpt"], hardware=hardware).to_yaml("accelerate")
    )
    jobs = {
        "apply fsdp1 offload": ["apply", str(paths["fsdp1 offload"])],
        "apply fsdp2": ["apply", str(paths["fsdp2 ckpt"])],
        "trainer": ["trainer", str(paths["fsdp1 every 2"])],
        "fabric fsdp1": ["fabric", str(paths["fsdp1 every 2"])],
        "fabric fsdp2": ["fabric", str(paths["fsdp2 every 2"])],
        "lightning cli": ["cli", str(lightning_yaml), str(paths["fsdp2 every 2"])],
        "accelerate": ["accelerate", str(accelerate_yaml), str(paths["fsdp1 ckpt"])],
        "hf trainer": ["hf", str(paths["fsdp2 ckpt"]), str(tmp_path / "hf-out")],
    }
    out = run_two_ranks(tmp_path, jobs, nproc=n)
    for name, result in out.items():
        assert len(result["losses"]) == STEPS, name
        assert all(math.isfinite(x) for x in result["losses"]), name
    every, all_blocks = [0, 2], [0, 1, 2, 3]
    offload = out["apply fsdp1 offload"]
    assert (offload["fsdp1 units"], offload["checkpointed blocks"]) == (5, every)
    assert offload["params on"] == ["cpu"] and "each rank's CUDA device" in offload["notice"][0]
    assert out["apply fsdp2"]["checkpointed blocks"] == all_blocks
    assert out["trainer"]["fsdp1 units"] == 5 and out["trainer"]["checkpointed blocks"] == every
    assert out["fabric fsdp1"]["checkpointed blocks"] == every
    assert out["fabric fsdp2"]["fsdp2 units"] == 5
    assert out["lightning cli"]["checkpointed blocks"] == every
    assert out["accelerate"]["fsdp1 units"] == 5
    assert out["accelerate"]["checkpointed blocks"] == all_blocks
    assert out["hf trainer"]["fsdp2 units"] >= 5
    assert out["hf trainer"]["checkpointed blocks"] == all_blocks
    bf16_compute = {"weight": "torch.bfloat16", "input": "torch.bfloat16"}
    for name in ("apply fsdp1 offload", "apply fsdp2", "trainer", "fabric fsdp1", "accelerate"):
        assert out[name]["compute"] == bf16_compute, name


# ---------------------------------------------------------------------------------------------
# Consumers that refuse FSDP on CPU: constructed from the output, compared field by field
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def gpt_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))


def fabric_settings(s: Any) -> dict[str, Any]:
    """Every setting autoshard chooses, read back from a constructed Fabric FSDPStrategy (its
    FSDP kwargs are ``_fsdp_kwargs`` where the Trainer's strategy has ``kwargs``)."""
    from tests.test_emit import strategy_settings

    s.kwargs = s._fsdp_kwargs
    return strategy_settings(s)


@pytest.mark.usefixtures("gpt_importable")
@pytest.mark.parametrize("case", ["full-bf16-ckpt", "hybrid-every2-fp32", "gradop-16-offload"])
def test_fabric_fsdp_strategy_has_every_setting_of_the_trainers(case: str) -> None:
    """Fabric's FSDPStrategy gets what the Trainer's gets (tests/test_emit.py checks that one
    against the recommendation field by field), and Fabric's precision plugin makes the mixed
    precision the trials used."""
    from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
    from lightning.fabric.strategies import FSDPStrategy

    from autoshard.sharding import fsdp1_kwargs
    from tests.test_emit import FSDP1_CASES, make_rec, strategy_settings

    rec = make_rec(FSDP1_CASES[case])
    fabric = rec.strategy(fabric=True)
    assert type(fabric) is FSDPStrategy
    assert fabric_settings(fabric) == strategy_settings(rec.strategy())
    c = rec.chosen.candidate
    precision = FSDPPrecision(rec.trainer_kwargs()["precision"])  # type: ignore[arg-type]
    assert precision.mixed_precision_config == fsdp1_kwargs(c, classes=set())["mixed_precision"]


def test_fabric_model_parallel_strategy_applies_the_plan_on_the_data_parallel_mesh() -> None:
    from lightning.fabric.strategies import ModelParallelStrategy

    from autoshard.config import Engine
    from tests.test_emit import candidate, make_rec

    rec = make_rec(candidate(engine=Engine.FSDP2))
    s = rec.strategy(fabric=True)
    assert type(s) is ModelParallelStrategy
    assert (s._data_parallel_size, s._tensor_parallel_size) == (2, 1)
    seen: list[Any] = []

    class Mesh:
        def __getitem__(self, name: str) -> str:
            return f"mesh[{name}]"

    s._parallelize_fn.plan = lambda model, mesh: seen.append(mesh) or model
    assert s._parallelize_fn("model", Mesh()) == "model" and seen == ["mesh[data_parallel]"]


def as_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers refuses bf16 and accelerate's FSDP plugin asks for the current GPU: be the
    GPU machine the output is meant for."""
    import accelerate.utils.dataclasses as acc_dataclasses
    import torch
    import transformers.training_args as hf_args

    monkeypatch.setattr(hf_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(acc_dataclasses, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def hf_training_arguments(args: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``TrainingArguments(**args)`` and the FSDP plugin the Trainer then builds from it
    (``FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)``, transformers' trainer.py)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    as_on_a_gpu_machine(monkeypatch)
    training = TrainingArguments(output_dir=str(EXAMPLES / "never-written"), **args)
    return training, FullyShardedDataParallelPlugin(**training.fsdp_plugin_args)


HF_CASES = ["full-bf16-ckpt", "hybrid-every2-fp32", "gradop-16-offload", "fsdp2-gradop-every2"]


def hf_case(case: str) -> Any:
    from autoshard.config import Checkpointing, Engine, Sharding
    from tests.test_emit import FSDP1_CASES, candidate, make_rec

    if case == "fsdp2-gradop-every2":
        return make_rec(
            candidate(
                engine=Engine.FSDP2, sharding=Sharding.SHARD_GRAD_OP,
                checkpointing=Checkpointing.EVERY_K, checkpoint_every=2,
            )
        )  # fmt: skip
    return make_rec(FSDP1_CASES[case])


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_training_arguments_carry_every_setting(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    import autoshard
    from autoshard.config import BackwardPrefetch, Checkpointing, Engine, Precision

    rec = hf_case(case)
    c = rec.chosen.candidate
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = rec.trainer_arguments()
    notices = [str(w.message) for w in caught if w.category is autoshard.HandoverNotice]
    training, plugin = hf_training_arguments(args, monkeypatch)
    assert training.fsdp is True
    assert training.bf16 is (c.precision is Precision.BF16_MIXED)
    assert training.fp16 is (c.precision is Precision.FP16_MIXED)
    assert training.per_device_train_batch_size == c.micro_batch_size
    assert plugin.fsdp_version == (2 if c.engine is Engine.FSDP2 else 1)
    assert plugin.transformer_cls_names_to_wrap == ["Block"]
    if c.engine is Engine.FSDP1:
        assert plugin.cpu_offload.offload_params is c.cpu_offload
    else:
        from torch.distributed.fsdp import CPUOffloadPolicy

        assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) is c.cpu_offload
    assert plugin.state_dict_type is StateDictType.FULL_STATE_DICT
    # FSDP's own checkpointing, not the Trainer's (which would add an all-gather in backward).
    assert plugin.activation_checkpointing is (c.checkpointing is not Checkpointing.NONE)
    assert not training.activation_checkpointing
    if c.engine is Engine.FSDP1:
        assert plugin.reshard_after_forward is ShardingStrategy[c.sharding.value]
        assert plugin.forward_prefetch is c.forward_prefetch
        assert plugin.backward_prefetch is (
            None
            if c.backward_prefetch is BackwardPrefetch.NONE
            else TorchPrefetch[c.backward_prefetch.value]
        )
        assert plugin.limit_all_gathers is c.limit_all_gathers
        assert plugin.use_orig_params is True
    else:
        assert plugin.reshard_after_forward is False  # SHARD_GRAD_OP
    # What the Trainer cannot express is said, in the arguments and as a warning, never dropped.
    notes = args["fsdp_config"]["autoshard"]["notes"]  # type: ignore[index]
    assert [f"Hugging Face Trainer: {n}" for n in notes] == notices
    every_k = c.checkpointing is Checkpointing.EVERY_K
    assert any("one in 2" in n and "checkpoints every block" in n for n in notes) is every_k
    if c.hybrid_mesh is not None:  # (2, 1) on one node of 2: not the node-sized groups
        assert any("groups of 1" in n and "rec.apply(model)" in n for n in notes)
    if c.engine is Engine.FSDP2 and c.precision is Precision.BF16_MIXED:
        assert any("reduce_dtype=fp32" in n for n in notes)


def test_export_hf_trainer_is_json_that_hf_argument_parser_reads(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import HfArgumentParser, TrainingArguments

    rec = hf_case("full-bf16-ckpt")
    (tmp_path / "recommendation.json").write_text(rec.to_yaml("json"))
    out = tmp_path / "hf.json"
    code, _, err = cli("export", tmp_path, "--format", "hf-trainer", "-o", out)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(rec.trainer_arguments()))
    as_on_a_gpu_machine(monkeypatch)
    (training,) = HfArgumentParser(TrainingArguments).parse_json_file(str(out))
    assert training.fsdp is True and training.bf16 is True
    assert training.fsdp_plugin_args["activation_checkpointing"] is True
    assert training.fsdp_plugin_args["backward_prefetch"] == "BACKWARD_PRE"


@pytest.mark.parametrize("case", ["hybrid-every2-fp32"])
def test_accelerate_yaml_says_what_it_cannot_express(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No prefetch is accelerate's NO_PREFETCH (its plugin refuses "NONE"); every-k
    checkpointing and other HYBRID_SHARD groups are said, with the closest setting used."""
    from tests.test_emit import FSDP1_CASES, load_like_accelerate, make_rec

    text = make_rec(FSDP1_CASES[case]).to_yaml("accelerate")
    _, plugin = load_like_accelerate(tmp_path, text, monkeypatch)
    assert plugin.backward_prefetch is None
    assert plugin.activation_checkpointing is True
    assert "# accelerate checkpoints every block or none; autoshard chose one in 2" in text
    assert "autoshard chose groups of 1 (mesh 2 x 1)" in text


def test_fsdp2_accelerate_yaml_says_its_reduce_dtype() -> None:
    from autoshard.config import Engine
    from tests.test_emit import candidate, make_rec

    text = make_rec(candidate(engine=Engine.FSDP2, precision="bf16-mixed")).to_yaml("accelerate")
    assert "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" in text


# ---------------------------------------------------------------------------------------------
# rec.apply and fsdp_kwargs in this process (a one-rank gloo group)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group() -> Any:
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_apply_without_a_process_group_says_what_to_do() -> None:
    from torch import nn

    from autoshard.errors import ConfigError
    from tests.test_emit import make_rec

    with pytest.raises(ConfigError, match=r"call torch.distributed.init_process_group\(\) first"):
        make_rec().apply(nn.Linear(2, 2))


@pytest.mark.usefixtures("gpt_importable", "one_rank_group")
def test_fsdp_kwargs_wrap_on_a_cpu_only_machine() -> None:
    """The README's plain-torch line, as written, on a machine without a GPU (FSDP1 refuses the
    CPU unless device_id says it)."""
    import gpt
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    from autoshard.config import Checkpointing
    from tests.test_emit import candidate, make_rec

    assert not torch.cuda.is_available()
    rec = make_rec(candidate(checkpointing=Checkpointing.ALL))
    model = gpt.build("tiny")
    fsdp_model = FullyShardedDataParallel(model, **rec.fsdp_kwargs())
    rec.apply_checkpointing(fsdp_model)
    assert structure(fsdp_model)["fsdp1 units"] == 5
    assert structure(fsdp_model)["checkpointed blocks"] == [0, 1, 2, 3]
    fsdp_model(torch.zeros(1, 8, dtype=torch.long)).sum().backward()


@pytest.mark.usefixtures("gpt_importable", "one_rank_group")
def test_apply_refuses_in_one_line_what_it_cannot_apply() -> None:
    import gpt
    import torch
    from torch import nn

    from autoshard.config import Sharding
    from autoshard.errors import ConfigError
    from tests.test_emit import candidate, make_rec

    with pytest.raises(ConfigError, match="does not contain"):
        make_rec().apply(nn.Sequential(nn.Linear(2, 2)))
    with torch.device("meta"):
        meta = gpt.build("tiny")
    with pytest.raises(ConfigError, match="meta device"):
        make_rec().apply(meta)
    with pytest.raises(ConfigError, match="needs a GPU"):
        make_rec(candidate(cpu_offload=True)).apply(gpt.build("tiny"))
    hybrid = make_rec(candidate(sharding=Sharding.HYBRID_SHARD, hybrid_mesh=(1, 2)))
    with pytest.raises(ConfigError, match="needs 2 ranks; this process group has 1"):
        hybrid.apply(gpt.build("tiny"))


@pytest.mark.usefixtures("gpt_importable", "one_rank_group")
def test_apply_wraps_as_chosen_and_says_where_it_runs() -> None:
    """rec.apply on one gloo rank: the chosen units and checkpointing, and one notice saying
    where FSDP runs and that the plan was for another world size."""
    import gpt
    import torch
    from torch import nn

    import autoshard
    from autoshard.config import Checkpointing, Engine, Sharding
    from autoshard.errors import ConfigError
    from tests.test_emit import candidate, make_rec

    rec = make_rec(candidate(checkpointing=Checkpointing.ALL, compile=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = rec.apply(gpt.build("tiny"))
    assert structure(model)["fsdp1 units"] == 5
    assert structure(model)["checkpointed blocks"] == [0, 1, 2, 3]
    notices = [str(w.message) for w in caught if w.category is autoshard.HandoverNotice]
    assert notices == [
        f"rec.apply(): {rec.chosen.candidate.label()} on the CPU of each rank (gloo; no CUDA "
        "device here, so FSDP runs on the CPU), 1 ranks (a micro-batch of 2 per rank is your "
        "loader's); torch.compile on the wrapped model: the first step compiles; planned for 2 "
        "ranks, so each rank's memory differs from the plan"
    ]
    # a checkpointed class the model lacks is refused by name, as a missing wrap class is
    stray = candidate(checkpointing=Checkpointing.ALL,
                      checkpoint_classes=("torch.nn.modules.linear.Bilinear",))  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        make_rec(stray).apply(gpt.build("tiny"))
    assert str(refused.value) == (
        "rec.apply(): the recommendation checkpoints torch.nn.modules.linear.Bilinear, which "
        "this model (GPT) does not contain; is it the model autoshard planned?"
    )
    # FSDP2's plan builds its own mesh where none (or a 1-D one for a 2-D choice) is given
    for sharding in (Sharding.FULL_SHARD, Sharding.NO_SHARD):
        plan = make_rec(candidate(engine=Engine.FSDP2, sharding=sharding)).fsdp2_plan()
        sharded = plan(gpt.build("tiny"))
        assert structure(sharded)["fsdp2 units"] == 5
        mesh = sharded._get_fsdp_state()._fsdp_param_group.mesh_info.mesh
        assert mesh.ndim == (2 if sharding is Sharding.NO_SHARD else 1)
    assert isinstance(model, nn.Module) and not torch.cuda.is_available()


def test_load_reads_each_output_back(tmp_path: Path) -> None:
    import autoshard
    from tests.test_emit import make_rec

    rec = make_rec()
    (tmp_path / "recommendation.json").write_text(rec.to_yaml("json"))
    for path in (tmp_path, tmp_path / "recommendation.json"):
        back = autoshard.load(path)
        assert type(back) is autoshard.Recommendation and back == rec
    estimate_json = tmp_path / "estimate.json"
    estimate_json.write_text(
        json.dumps({"estimates": [], "recommendation": rec.model_dump(mode="json")})
    )
    assert autoshard.load(estimate_json) == rec
    assert "load" in autoshard.__all__


if __name__ == "__main__":
    main()
