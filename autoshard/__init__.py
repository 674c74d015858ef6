"""autoshard: pick the PyTorch FSDP configuration for a model and a set of GPUs."""

from __future__ import annotations

from autoshard.analyze import analyze_model, analyze_target
from autoshard.api import NoGPUWarning, detect_hardware, estimate, recommend
from autoshard.errors import AutoshardError
from autoshard.memory import (
    ActivationProfile,
    estimate_all,
    estimate_memory,
    peak_moments,
    profile_activations,
)
from autoshard.models import (
    Candidate,
    Hardware,
    MemoryEstimate,
    ModelProfile,
    Recommendation,
    TrialResult,
    WorkloadSpec,
)
from autoshard.search import TuneOptions, tune
from autoshard.simulate import simulate_memory
from autoshard.space import enumerate_candidates
from autoshard.target import TargetSpec

__version__ = "0.1.0"

__all__ = [
    "ActivationProfile",
    "AutoshardError",
    "Candidate",
    "Hardware",
    "MemoryEstimate",
    "ModelProfile",
    "NoGPUWarning",
    "Recommendation",
    "TargetSpec",
    "TrialResult",
    "TuneOptions",
    "WorkloadSpec",
    "__version__",
    "analyze_model",
    "analyze_target",
    "detect_hardware",
    "enumerate_candidates",
    "estimate",
    "estimate_all",
    "estimate_memory",
    "peak_moments",
    "profile_activations",
    "recommend",
    "simulate_memory",
    "tune",
]
