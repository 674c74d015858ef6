"""What the step-time model reads besides the candidate: one object instead of the same nine
arguments handed down through :func:`~autoshard.predict.speed.predict_speed`,
:func:`~autoshard.predict.speed.turn_seconds` and their helpers.

A study predicts many candidates on the same model, hardware and workload, so the candidate
stays apart: ``speed_of(inputs, candidate)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from autoshard.config import Hardware, WorkloadSpec
from autoshard.gpus import GPUSpec
from autoshard.predict.factors import SpeedFactors
from autoshard.predict.flops import FlopProfile
from autoshard.predict.recipe import LinearShapes
from autoshard.results import ModelProfile


class SpeedOptions(TypedDict, total=False):
    """The keyword options of :func:`~autoshard.predict.speed.predict_speed` (each a field of
    :class:`SpeedInputs`, same name and meaning)."""

    gpu: GPUSpec | None
    tf32: bool
    skip_sync: bool | None
    linears: LinearShapes | None
    host_threads: int | None


@dataclass(frozen=True)
class SpeedInputs:
    """The model's profile and FLOPs, the hardware and workload planned for, and how to read
    them: ``factors`` (the defaults for the GPU when None), ``gpu`` (the resolved catalogue
    entry; :func:`~autoshard.predict.hardware.speed_for`'s when None), ``tf32`` (fp32 matrix
    products on tensor cores), ``skip_sync`` (whether the micro-batches before the last skip the
    gradient sync; None: as ``workload.loop`` does), ``linears`` (the layers float8
    converts, :func:`~autoshard.predict.recipe.linear_shapes`) and ``host_threads`` (each rank's
    threads for CPU offload's host optimizer step; None: the run's,
    :func:`~autoshard.predict.optimizer_step.host_optimizer_threads`; autoshard's GPU trials run
    :data:`~autoshard.predict.optimizer_step.HOST_OPTIMIZER_THREADS`).

    >>> from autoshard import Hardware, WorkloadSpec
    >>> from autoshard.results import ModelProfile
    >>> from autoshard.predict.flops import FlopProfile
    >>> one = Hardware(gpus_per_node=1, gpu_memory=80 * 2**30)
    >>> inputs = SpeedInputs(ModelProfile.model_construct(), FlopProfile.model_construct(), one,
    ...                      WorkloadSpec(), tf32=True)
    >>> inputs.tf32, inputs.gpu, inputs.factors
    (True, None, None)
    """

    profile: ModelProfile
    flops: FlopProfile
    hardware: Hardware
    workload: WorkloadSpec
    factors: SpeedFactors | None = None
    gpu: GPUSpec | None = None
    tf32: bool = False
    skip_sync: bool | None = None
    linears: LinearShapes | None = None
    host_threads: int | None = None
