"""Gradient accumulation's memory (autoshard/predict/accumulation.py): what a micro-batch keeps when
the gradient sync is skipped (unsharded gradients, the head's waiting in the root), and the
analytic accumulation against the simulation."""

from __future__ import annotations

import pytest

from autoshard.config import Candidate, WorkloadSpec
from autoshard.engine import skips_gradient_sync
from autoshard.predict.accumulation import accumulated_gradient_bytes
from autoshard.predict.analytic import estimate_memory
from autoshard.predict.step_bytes import fsdp2_head_gradient
from tests.test_loop import GLOO2, gpt

from .conftest import moments_of


@pytest.mark.parametrize(
    ("engine", "loop", "kept_per_param"),
    [
        ("fsdp1", "lightning", 2),  # the Trainer's no_sync: unsharded, in the compute dtype
        ("fsdp1", "plain", 2),
        ("fsdp2", "plain", 4),  # set_requires_gradient_sync(False): upcast to the fp32 reduce
        ("fsdp2", "lightning", 0),  # ModelParallelStrategy syncs every micro-batch
    ],
)
def test_accumulation_keeps_unsharded_gradients_when_the_sync_is_skipped(
    tiny, engine, loop, kept_per_param
) -> None:
    profile, _ = tiny
    c = Candidate(engine=engine, wrap_classes=profile.wrap_policy, precision="bf16-mixed")
    workload = WorkloadSpec(seq_len=64, loop=loop, accumulate=4)
    assert skips_gradient_sync(c, workload) == bool(kept_per_param)
    one = moments_of(tiny, c, loop=loop, accumulate=1)
    four = moments_of(tiny, c, loop=loop, accumulate=4)
    if kept_per_param:
        kept = accumulated_gradient_bytes(profile, c, GLOO2)
        assert kept == kept_per_param * profile.total_params
        # the later micro-batches' loss: the first's, with every unit's unsharded gradient
        assert four["accumulating loss"].total - one["loss"].total == kept
    else:
        # the sharded gradients stay allocated through the later micro-batches' backward
        sharded = one["optimizer step"].gradients
        # beside the head's gradient, which waits unsharded in the root (FSDP2)
        head = fsdp2_head_gradient(profile, c)
        assert head == profile.vocab_size * profile.hidden_size * 2
        assert four["accumulating top block backward"].gradients == sharded + head
        assert one["top block backward"].gradients == head
    assert max(m.total for m in four.values()) > max(m.total for m in one.values())


@pytest.mark.parametrize(
    ("engine", "sharding", "loop"),
    [("fsdp1", "FULL_SHARD", "plain"), ("fsdp2", "FULL_SHARD", "lightning")],
)
def test_analytic_accumulation_agrees_with_the_simulation(tiny, engine, sharding, loop) -> None:
    from autoshard.predict.simulate import simulate_memory

    profile, acts = tiny
    c = Candidate(engine=engine, sharding=sharding, wrap_classes=profile.wrap_policy)
    workload = WorkloadSpec(seq_len=64, loop=loop, accumulate=4)
    analytic = estimate_memory(profile, c, GLOO2, workload, activations=acts)
    simulated = simulate_memory(gpt(), c, GLOO2, workload)
    one = simulate_memory(gpt(), c, GLOO2, workload.model_copy(update={"accumulate": 1}))
    assert simulated.gpu_peak > one.gpu_peak  # accumulation costs memory
    assert analytic.gpu_peak == pytest.approx(simulated.gpu_peak, rel=0.05)
