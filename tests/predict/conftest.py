"""What tests of the predict modules share: the tiny GPT profiled at sequence 64 (a fixture),
and the analytic moments of a candidate on it."""

from __future__ import annotations

import pytest

from autoshard.analyze import analyze_target
from autoshard.config import Candidate, Precision, WorkloadSpec
from autoshard.predict.activations import profile_activations
from autoshard.predict.analytic import peak_moments
from tests.test_loop import GLOO2, gpt


@pytest.fixture(scope="module")
def tiny() -> tuple:
    profile, built = analyze_target(gpt())
    acts = profile_activations(
        built.model, profile, WorkloadSpec(seq_len=64), precisions=tuple(Precision)
    )
    return profile, acts


def moments_of(tiny, candidate: Candidate, **workload: object) -> dict:
    profile, acts = tiny
    moments, _ = peak_moments(profile, candidate, GLOO2, WorkloadSpec(seq_len=64, **workload), acts)
    return moments
