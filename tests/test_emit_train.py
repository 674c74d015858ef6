"""The emitted FSDP1 kwargs and FSDP2 plan train a real model on 2 gloo processes on CPU.

This file is also the worker script: the test runs it under ``torch.distributed.run``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autoshard.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]


def train(rec_path: str, steps: int = 4) -> dict[str, object]:
    """Wrap examples/gpt.py's tiny GPT as the recommendation says and take a few steps."""
    import gpt
    import torch
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from autoshard.config import Engine
    from autoshard.emit.runtime import apply_checkpointing
    from autoshard.recommendation import Recommendation

    rec = Recommendation.model_validate_json(Path(rec_path).read_text())
    torch.manual_seed(0)
    model = gpt.build("tiny")
    if rec.chosen.candidate.engine is Engine.FSDP1:
        # FSDP1 on CPU needs device_id=cpu (design notes).
        model = FSDP(model, **rec.fsdp_kwargs(device=torch.device("cpu"), model=model))
        apply_checkpointing(model, rec)
        units = sum(isinstance(m, FSDP) for m in model.modules())
        mesh_shape: list[int] = []
    else:
        from torch.distributed.device_mesh import init_device_mesh

        # A 1-D mesh, as Lightning's ModelParallelStrategy hands configure_model.
        flat = init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",))
        model = rec.fsdp2_plan()(model, flat)  # type: ignore[operator]
        units = sum(isinstance(m, FSDPModule) for m in model.modules())
        mesh_shape = list(next(model.parameters()).device_mesh.shape)
    ckpt = sum(isinstance(m, CheckpointWrapper) for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 4096, (2, 33), generator=gen)
    losses = []
    gathered_after_forward: dict[str, bool] = {}
    for _ in range(steps):
        logits = model(idx[:, :-1])
        if not gathered_after_forward and rec.chosen.candidate.engine is Engine.FSDP2:
            # between forward and backward: a unit that resharded holds DTensor shards again
            from torch.distributed.tensor import DTensor

            gathered_after_forward = {
                "root": not isinstance(model.lm_head.weight, DTensor),
                "last block": not isinstance(model.blocks[-1].mlp.up.weight, DTensor),
                "first block": not isinstance(model.blocks[0].mlp.up.weight, DTensor),
            }
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "units": units,
        "ckpt": ckpt,
        "losses": losses,
        "mesh": mesh_shape,
        "gathered after forward": gathered_after_forward,
    }


def main() -> None:
    import torch.distributed as dist

    from autoshard.trials.worker import exit_worker

    dist.init_process_group("gloo")
    out = {path: train(path) for path in sys.argv[2:]}
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(out))
    exit_worker()  # not a plain exit: gloo can abort the interpreter's finalization


@pytest.mark.slow
def test_fsdp1_kwargs_and_fsdp2_plan_train_on_two_gloo_processes(tmp_path: Path) -> None:
    from autoshard.config import Checkpointing, Engine, Precision, Sharding
    from tests.test_emit import candidate, make_rec

    fsdp1 = make_rec(candidate(precision=Precision.BF16_MIXED, checkpointing=Checkpointing.ALL))
    fsdp2 = make_rec(
        candidate(
            engine=Engine.FSDP2,
            sharding=Sharding.HYBRID_SHARD,
            hybrid_mesh=(1, 2),
            checkpointing=Checkpointing.EVERY_K,
            checkpoint_every=2,
        )
    )
    paths = []
    for name, rec in (("fsdp1", fsdp1), ("fsdp2", fsdp2)):
        paths.append(str(tmp_path / f"{name}.json"))
        Path(paths[-1]).write_text(rec.to_yaml("json"))
    result = tmp_path / "result.json"
    env = child_env(ROOT / "examples", ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--standalone", __file__, str(result), *paths],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    one, two = out[paths[0]], out[paths[1]]
    # 4 blocks + the root: one FSDP unit each; every block checkpointed, or every second one.
    assert (one["units"], one["ckpt"]) == (5, 4)
    assert (two["units"], two["ckpt"], two["mesh"]) == (5, 2, [1, 2])
    for losses in (one["losses"], two["losses"]):
        assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.slow
def test_fsdp2_plans_of_every_reshard_policy_train_on_two_gloo_processes(tmp_path: Path) -> None:
    """Each reshard policy's plan trains, and keeps gathered after forward exactly the units it
    names: nothing, the root (embedding and head), or the root and the last block."""
    from autoshard.config import Engine, Precision, Reshard
    from tests.test_emit import candidate, make_rec

    paths = []
    for reshard in Reshard:
        rec = make_rec(candidate(engine=Engine.FSDP2, precision=Precision.FP32, reshard=reshard))
        paths.append(str(tmp_path / f"{reshard.value}.json"))
        Path(paths[-1]).write_text(rec.to_yaml("json"))
    out = _run_two_ranks(tmp_path, paths)
    expected = {
        "all": {"root": False, "last block": False, "first block": False},
        "keep_root": {"root": True, "last block": False, "first block": False},
        "keep_root_and_last": {"root": True, "last block": True, "first block": False},
    }
    for reshard, path in zip(Reshard, paths, strict=True):
        result = out[path]
        assert result["units"] == 5, result
        assert result["gathered after forward"] == expected[reshard.value], reshard
        assert result["losses"][-1] < result["losses"][0] - 0.1, result["losses"]


def _run_two_ranks(tmp_path: Path, paths: list[str]) -> dict[str, Any]:
    result = tmp_path / "result.json"
    env = child_env(ROOT / "examples", ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--standalone", __file__, str(result), *paths],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(result.read_text()))


if __name__ == "__main__":
    main()
