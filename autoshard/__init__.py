"""autoshard: pick the PyTorch FSDP configuration for a model and a set of GPUs."""

from __future__ import annotations

from autoshard.analyze import analyze_model, analyze_target
from autoshard.errors import AutoshardError
from autoshard.models import (
    Candidate,
    Hardware,
    MemoryEstimate,
    ModelProfile,
    Recommendation,
    TrialResult,
    WorkloadSpec,
)
from autoshard.target import TargetSpec

__version__ = "0.1.0"

__all__ = [
    "AutoshardError",
    "Candidate",
    "Hardware",
    "MemoryEstimate",
    "ModelProfile",
    "Recommendation",
    "TargetSpec",
    "TrialResult",
    "WorkloadSpec",
    "__version__",
    "analyze_model",
    "analyze_target",
]
