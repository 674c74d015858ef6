"""autoshard: pick the PyTorch FSDP configuration for a model and a set of GPUs."""

from __future__ import annotations

import gc

# torch's import makes about a million objects, which the collector would walk again and again
# while they are made (0.19 s of a 1.3 s import): paused for the imports, as it was after them.
_collecting = gc.isenabled()
gc.disable()
try:
    from importlib.metadata import PackageNotFoundError, version

    from autoshard.analyze import analyze_model, analyze_target
    from autoshard.api import Estimates, estimate, recommend, tune
    from autoshard.config import Candidate, Hardware, WorkloadSpec
    from autoshard.detect import detect_hardware
    from autoshard.errors import AutoshardError, HandoverNotice, NoGPUWarning, PlanWarning
    from autoshard.options import PlanOptions, TuneOptions
    from autoshard.predict.activations import ActivationProfile, profile_activations
    from autoshard.predict.analytic import estimate_all, estimate_memory, peak_moments
    from autoshard.predict.simulate import simulate_memory
    from autoshard.recommendation import Recommendation, load
    from autoshard.results import MemoryEstimate, ModelProfile, TrialResult
    from autoshard.space import enumerate_candidates
    from autoshard.target.resolve import TargetSpec
finally:
    if not gc.get_freeze_count():  # what they made survives: the oldest generation, unwalked
        gc.freeze()
        gc.unfreeze()
    if _collecting:
        gc.enable()

try:
    __version__ = version("autoshard")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "ActivationProfile",
    "AutoshardError",
    "Candidate",
    "Estimates",
    "HandoverNotice",
    "Hardware",
    "MemoryEstimate",
    "ModelProfile",
    "NoGPUWarning",
    "PlanOptions",
    "PlanWarning",
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
    "load",
    "peak_moments",
    "profile_activations",
    "recommend",
    "simulate_memory",
    "tune",
]
