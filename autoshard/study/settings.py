"""The name of a study: a fingerprint of everything that decides which trials it runs and what
they measure. The same settings give the same name (the study resumes); changed settings give a
new study in the same storage, so that trials measured under other settings are never reused.

What it measures includes the model itself, not only the factory that builds it: its structure
(:func:`model_fingerprint`: every parameter's and buffer's module class, name, shape and dtype),
its forward's computation (the operators and block calls of the fake forward the estimates run:
:mod:`autoshard.predict.forward_digest`), the example batch's shapes, and the version of the
trial workers' measurements (:data:`MEASUREMENT`). A model file edited between two runs (its
layers, or only what its forward does with them), or another project's ``model.py:build`` in the
same output folder, starts a study of its own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from pydantic import Field
from torch import nn

from autoshard.config import Engine, Frozen, Hardware, Precision, WorkloadSpec
from autoshard.target.resolve import TargetSpec

# Bumped when what a study stores changes meaning: older studies are then not resumed.
STUDY_FORMAT = "autoshard.study/2"
# Bump when a change to the trial workers alters what a trial measures (how steps are timed,
# how memory is counted, the warm-up): studies measured by the older workers are then not resumed.
MEASUREMENT = "autoshard.trials/1"


class StudySettings(Frozen):
    """What a study's trials depend on (how long to run it, ``--trials``, is not part of it).

    >>> from autoshard import Hardware, TargetSpec, WorkloadSpec
    >>> from autoshard.study.settings import StudySettings
    >>> target = TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"})
    >>> hardware = Hardware(gpus_per_node=2, gpu_memory=2**30)
    >>> a = StudySettings.of(target, hardware, WorkloadSpec(seq_len=64), micro_batch_sizes=(2, 1))
    >>> b = StudySettings.of(target, hardware, WorkloadSpec(seq_len=64), micro_batch_sizes=(1, 2))
    >>> a.name() == b.name(), a.name() == a.model_copy(update={"micro_batch_sizes": (1,)}).name()
    (True, False)
    """

    target: TargetSpec = Field(..., description="The model factory and its arguments.")
    hardware: Hardware = Field(..., description="The GPUs planned for.")
    workload: WorkloadSpec = Field(
        ..., description="One training step (its micro_batch_size is micro_batch_sizes[0])."
    )
    engine: Engine = Field(Engine.FSDP1, description="FSDP implementation.")
    precisions: tuple[Precision, ...] = Field(
        (), description="Precisions tried, sorted (empty: autoshard's default for the hardware)."
    )
    micro_batch_sizes: tuple[int, ...] = Field(..., description="Micro-batch sizes, sorted.")
    memory_cap: int | None = Field(
        None, description="Bytes a trial's measured peak may reach (None: the usable GPU memory)."
    )
    model: str = Field("", description="The model's structure (model_fingerprint).")
    params: int = Field(0, description="The model's parameters (for the line saying it changed).")
    batch: str = Field("", description="The example batch's shapes and dtypes (batch_shapes).")
    computation: str = Field(
        "",
        description="What the forward computes: the digest of its operators and block calls "
        "(ActivationProfile.forward_digest; '' where the forward did not run on fake tensors).",
    )

    @classmethod
    def of(
        cls,
        target: TargetSpec,
        hardware: Hardware,
        workload: WorkloadSpec,
        *,
        engine: Engine | str = Engine.FSDP1,
        precisions: Iterable[Precision | str] | None = None,
        micro_batch_sizes: Iterable[int] | None = None,
        memory_cap: int | None = None,
    ) -> StudySettings:
        """Settings in canonical form: the order of precisions or batch sizes does not matter.
        The model's own identity is added by :meth:`with_model`."""
        from autoshard.space import default_precisions

        chosen = tuple(Precision(p) for p in precisions or ()) or default_precisions(hardware)
        sizes = tuple(micro_batch_sizes or (workload.micro_batch_size,))
        return cls(
            target=target,
            hardware=hardware,
            workload=workload,
            engine=Engine(engine),
            precisions=tuple(sorted(set(chosen), key=lambda p: p.value)),
            micro_batch_sizes=tuple(sorted(set(sizes))),
            memory_cap=memory_cap,
        )

    def with_model(
        self, model: nn.Module | None, batch: Any = None, computation: str = ""
    ) -> StudySettings:
        """These settings for ``model`` (its structure and parameter count), its example
        ``batch`` (shapes and dtypes) and its forward's ``computation`` digest."""
        return self.model_copy(
            update={
                "model": model_fingerprint(model) if model is not None else "",
                "params": sum(p.numel() for p in model.parameters()) if model is not None else 0,
                "batch": batch_shapes(batch),
                "computation": computation,
            }
        )

    def name(self, candidates: Sequence[str] = ()) -> str:
        """``autoshard-<12 hex digits>``; ``candidates`` (the labels of the candidate set, when
        known) are part of it, so that a version of autoshard that enumerates other candidates
        for the same settings starts a new study rather than mixing two spaces."""
        data = self.model_dump(mode="json")
        # The first size is in micro_batch_sizes already: `--batch-size 2,1` equals `1,2`.
        data["workload"].pop("micro_batch_size", None)
        key = json.dumps([STUDY_FORMAT, MEASUREMENT, data, sorted(candidates)], sort_keys=True)
        return "autoshard-" + hashlib.sha256(key.encode()).hexdigest()[:12]

    def differences(self, other: StudySettings) -> list[str]:
        """What differs from ``other``, in words ("the model (1,872,640 -> 3,5... parameters)")."""
        out = []
        if self.target != other.target:
            out.append(f"the target ({other.target} -> {self.target})")
        elif self.model != other.model:
            out.append(
                f"the model ({other.params:,} -> {self.params:,} parameters)"
                if self.params != other.params
                else "the model's structure"
            )
        elif self.computation != other.computation and other.computation:
            out.append("the model's forward (what it computes, traced)")
        for name in ("batch", "hardware", "workload", "engine", "precisions",
                     "micro_batch_sizes", "memory_cap"):  # fmt: skip
            if getattr(self, name) != getattr(other, name):
                out.append("the example batch" if name == "batch" else name.replace("_", " "))
        return out


def model_fingerprint(model: nn.Module) -> str:
    """A digest of the model's structure: each parameter's and buffer's module class, name,
    shape, dtype and trainability (tied ones once). Values are not read: it works on meta.

    >>> a = model_fingerprint(nn.Linear(4, 4))
    >>> a == model_fingerprint(nn.Linear(4, 4)), a == model_fingerprint(nn.Linear(4, 8))
    (True, False)
    """
    digest = hashlib.sha256()
    seen: set[int] = set()
    for path, module in model.named_modules():
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in own:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            grad = bool(getattr(tensor, "requires_grad", False))
            line = f"{path}.{name} {kind} {tuple(tensor.shape)} {tensor.dtype} {grad}\n"
            digest.update(line.encode())
    return digest.hexdigest()[:16]


def batch_shapes(batch: Any, depth: int = 0) -> str:
    """The shapes and dtypes of an example batch (tensors in dicts, lists, tuples), as text.

    >>> batch_shapes({"ids": torch.zeros(2, 8, dtype=torch.long)})
    "{'ids': int64[2, 8]}"
    """
    if depth > 8:
        return "..."
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if isinstance(batch, dict):
        inner = ", ".join(f"{k!r}: {batch_shapes(v, depth + 1)}" for k, v in batch.items())
        return "{" + inner + "}"
    if isinstance(batch, list | tuple):
        inner = ", ".join(batch_shapes(v, depth + 1) for v in batch)
        return f"[{inner}]" if isinstance(batch, list) else f"({inner})"
    if batch is None or isinstance(batch, bool | int | float | str):
        return repr(batch)
    return type(batch).__name__
