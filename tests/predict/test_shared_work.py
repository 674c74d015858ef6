"""What candidates share is computed once (the memoised turns of predict/timeline.py, the
pieces' seconds of predict/work_seconds.py): it must never be shared across models or GPUs.
Every answer of one process that estimates several models and GPUs in turn equals the answer
of that model and GPU estimated with the memos empty."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from autoshard.analyze import analyze_target
from autoshard.config import Hardware, WorkloadSpec
from autoshard.predict import timeline, work_seconds
from autoshard.predict.activations import profile_activations
from autoshard.predict.analytic import estimate_all
from autoshard.predict.flops import profile_flops
from autoshard.predict.speed import predict_speed
from autoshard.space import Knobs, enumerate_candidates
from autoshard.target.resolve import TargetSpec

from ..conftest import EXAMPLES

GIB = 2**30
WORKLOAD = WorkloadSpec(seq_len=2048)
# The same block count, other widths (wide enough that FLOPs, not launches, time the blocks):
# a memo keyed on the model's shape alone would mix them.
SHAPE = {"size": "tiny", "n_layer": 4, "n_head": 16, "max_seq_len": 2048}
MODELS = {"narrow": {**SHAPE, "d_model": 2048}, "wide": {**SHAPE, "d_model": 4096}}
GPUS = {
    "h100 x 8": Hardware(gpus_per_node=8, gpu_memory=80 * GIB, gpu="h100-sxm"),
    "a100 x 2 x 4": Hardware(gpus_per_node=4, nodes=2, gpu_memory=40 * GIB, gpu="a100-40gb-sxm"),
}


def _forget() -> None:
    timeline._turns.cache_clear()
    work_seconds.piece_seconds.cache_clear()


@pytest.fixture(scope="module")
def profiles() -> dict[str, tuple[Any, Any, Any]]:
    out = {}
    for name, kwargs in MODELS.items():
        profile, built = analyze_target(TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs=kwargs))
        flops = profile_flops(built.model, profile, WORKLOAD)
        out[name] = (profile, flops, profile_activations(built.model, profile, WORKLOAD))
    return out


def _answers(profiles: dict[str, tuple[Any, Any, Any]], model: str, gpu: str) -> list[Any]:
    """Every candidate's peak (and where) and step time (and its breakdown)."""
    profile, flops, acts = profiles[model]
    hardware = GPUS[gpu]
    candidates = enumerate_candidates(
        profile, hardware, WORKLOAD, Knobs(micro_batch_sizes=(1, 4), compiles=(False, True))
    )
    memory = estimate_all(profile, candidates, hardware, WORKLOAD, activations=acts)
    return [
        (m.gpu_peak, m.peak_at, s.step_time_s, s.breakdown)
        for m, s in zip(
            memory,
            (predict_speed(profile, flops, c, hardware, WORKLOAD) for c in candidates),
            strict=True,
        )
    ]


def test_models_and_gpus_estimated_in_one_process_each_get_their_own_answer(
    profiles: dict[str, tuple[Any, Any, Any]],
) -> None:
    pairs = list(itertools.product(MODELS, GPUS))
    alone = {}
    for pair in pairs:
        _forget()
        alone[pair] = _answers(profiles, *pair)
    assert len({repr(a) for a in alone.values()}) == len(pairs)  # each pair its own numbers
    _forget()
    for pair in [*pairs, *reversed(pairs)]:  # the memos warm with the others' work
        assert _answers(profiles, *pair) == alone[pair], pair
