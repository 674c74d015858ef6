"""autoshard: pick the PyTorch FSDP configuration for a model and a set of GPUs."""

from __future__ import annotations

from autoshard.analyze import analyze_model, analyze_target
from autoshard.api import NoGPUWarning, detect_hardware, estimate, recommend
from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.errors import AutoshardError
from autoshard.predict.activations import ActivationProfile, profile_activations
from autoshard.predict.analytic import estimate_all, estimate_memory, peak_moments
from autoshard.predict.simulate import simulate_memory
from autoshard.results import MemoryEstimate, ModelProfile, Recommendation, TrialResult
from autoshard.search import TuneOptions, tune
from autoshard.space import enumerate_candidates
from autoshard.target.resolve import TargetSpec

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
