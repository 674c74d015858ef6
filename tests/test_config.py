"""config.OPTIMIZER_TRAITS: every row builds the optimizer it names and keeps the states it says,
measured on torch's own optimizers (shaped tensors, and the 1-D views FSDP1's sharded flat
parameters hand them); its stacks' names for it are theirs; and, on 2 gloo processes, the
estimate of a step with it is within 5% of the measured peak.

A new optimizer is its row in autoshard/config.py and its points in ``GLOO_POINTS`` here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autoshard.analyze import analyze_model
from autoshard.config import (
    OPTIMIZER_TRAITS,
    Candidate,
    Hardware,
    Optimizer,
    OptimizerImpl,
    Precision,
    WorkloadSpec,
)
from autoshard.engine import optimizer_bytes
from autoshard.predict.optimizer_step import optimizer_bytes_per_param
from autoshard.sharding import make_optimizer
from tests import gloo_peaks

ROOT = Path(__file__).resolve().parents[1]
ROWS = [(o, i) for o, row in OPTIMIZER_TRAITS.items() for i in row.impls]


def shaped_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """Matrices, vectors, an embedding and a 3-D parameter: every shape rule of a row."""
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 64), nn.LayerNorm(64),
                          nn.Linear(64, 16, bias=False))  # fmt: skip
    model.register_parameter("experts", nn.Parameter(torch.randn(3, 16, 8)))
    return model.to(dtype)


def state_bytes_after_a_step(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> int:
    """Bytes of the states the optimizer keeps after one step (not its step counters)."""
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for k, v in state.items()
        if torch.is_tensor(v) and k != "step"
    )


@pytest.mark.parametrize(("optimizer", "impl"), ROWS, ids=lambda x: getattr(x, "value", x))
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16_TRUE])
def test_each_row_keeps_the_states_it_says(
    optimizer: Optimizer, impl: OptimizerImpl, precision: Precision
) -> None:
    if impl is OptimizerImpl.FUSED and precision is Precision.BF16_TRUE:
        pytest.skip("torch's fused CPU kernels take fp32 (a GPU's take bf16 too)")
    dtype = torch.bfloat16 if precision is Precision.BF16_TRUE else torch.float32
    model = shaped_model(dtype)
    profile = analyze_model(model)
    c = Candidate(optimizer=optimizer, optimizer_impl=impl, precision=precision)
    # one rank (FSDP1 NO_SHARD): the optimizer gets the parameters in their own shapes
    built = make_optimizer(model.parameters(), c)
    assert type(built).__name__ == OPTIMIZER_TRAITS[optimizer].class_path.rpartition(".")[2]
    shaped = state_bytes_after_a_step(built, list(model.parameters()))
    assert optimizer_bytes(profile, c, shard=1)[0] == shaped
    # FSDP1 FULL_SHARD on 2 ranks: its rank's half of the parameters as 1-D views
    sharded = c.model_copy(update={"sharding": "FULL_SHARD"})
    half = profile.trainable_params // 2
    views = [nn.Parameter(torch.zeros(half, dtype=dtype))]
    flat = state_bytes_after_a_step(make_optimizer(views, sharded), views)
    assert profile.trainable_params % 2 == 0
    assert optimizer_bytes(profile, sharded, shard=2)[0] == flat


def test_the_rows_differ_where_the_optimizers_do() -> None:
    # the measured states above, as numbers: fp32, 1-D views of 2 x 4,000 elements each
    profile = analyze_model(nn.Linear(100, 80))  # 8,080 parameters
    states = {
        o: optimizer_bytes(profile, Candidate(optimizer=o, sharding="FULL_SHARD"), shard=2)
        for o in Optimizer
    }
    assert states[Optimizer.ADAMW][0] == states[Optimizer.ADAM][0] == 2 * 4 * 4040
    assert states[Optimizer.SGD][0] == states[Optimizer.ADAFACTOR][0] == 4 * 4040
    # shaped (one rank): Adafactor keeps the bias whole and a row and a column of the weight
    shaped = optimizer_bytes(profile, Candidate(optimizer="adafactor", sharding="NO_SHARD"), 1)
    assert shaped[0] == 4 * (80 + 80 + 100)
    # the foreach transient: a copy of the shard for AdamW and Adafactor, none for SGD
    assert [states[o][1] for o in Optimizer] == [4 * 4040, 4 * 4040, 0, 4 * 4040]
    # passes over memory: Adafactor has no fused kernel, 19 passes in its foreach
    per_param = [optimizer_bytes_per_param(Candidate(optimizer=o)) for o in Optimizer]
    assert per_param == [4 * 20, 4 * 20, 4 * 8, 4 * 19]


def test_a_row_refuses_what_its_optimizer_cannot_do() -> None:
    with pytest.raises(ValueError, match="adafactor has no fused implementation"):
        Candidate(optimizer="adafactor", optimizer_impl="fused")
    with pytest.raises(ValueError, match="adafactor runs with engine fsdp1 only"):
        Candidate(optimizer="adafactor", engine="fsdp2")


def test_the_names_each_stack_gives_them_are_its_own() -> None:
    transformers = pytest.importorskip("transformers")
    names = {n.value for n in transformers.training_args.OptimizerNames}
    for row in OPTIMIZER_TRAITS.values():
        assert set(row.hf_trainer_names.values()) <= names
        assert set(row.hf_trainer_names) <= set(row.impls)
    # torchtitan 0.2's build_optimizers (components/optimizer.py) knows these two
    titan = {row.torchtitan_name for row in OPTIMIZER_TRAITS.values()} - {None}
    assert titan == {"Adam", "AdamW"}


# ---------------------------------------------------------------------------------------------
# A real step on 2 gloo processes
# ---------------------------------------------------------------------------------------------

TARGET = {"spec": f"{ROOT}/examples/gpt.py:build", "kwargs": {"size": "tiny"}}
SEQ = 128
# Adafactor where its states are a whole copy of the shard (FSDP1's flat views) and where they
# are factored (NO_SHARD), against SGD on the same configuration
GLOO_POINTS: list[dict[str, Any]] = [
    dict(engine="fsdp1", sharding="FULL_SHARD", precision="32-true", optimizer="adafactor"),
    dict(engine="fsdp1", sharding="NO_SHARD", precision="32-true", optimizer="adafactor"),
    dict(engine="fsdp1", sharding="FULL_SHARD", precision="32-true", optimizer="sgd"),
]


def main() -> None:
    gloo_peaks.measure_peaks(TARGET, GLOO_POINTS, SEQ)


@pytest.mark.slow
def test_a_step_of_each_optimizer_peaks_where_estimated(tmp_path: Path) -> None:
    from autoshard.predict.activations import profile_activations
    from autoshard.predict.analytic import estimate_memory
    from autoshard.target.resolve import TargetSpec, build_target

    measured = gloo_peaks.launch(__file__, tmp_path)
    built = build_target(TargetSpec(**TARGET))
    profile = analyze_model(built.model)
    workload = WorkloadSpec(seq_len=SEQ)
    acts = profile_activations(built.model, profile, workload)
    gloo = Hardware(gpus_per_node=2, gpu_memory=80 * 1024**3, backend="gloo")
    for candidate, real in zip(gloo_peaks.candidates(TARGET, GLOO_POINTS), measured, strict=True):
        ana = estimate_memory(profile, candidate, gloo, workload, activations=acts)
        assert abs(ana.gpu_peak - real) <= 0.05 * real, (candidate.label(), ana.gpu_peak, real)


if __name__ == "__main__":
    main()
