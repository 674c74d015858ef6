"""The name of a study: a fingerprint of everything that decides which trials it runs and what
they measure. The same settings give the same name (the study resumes); changed settings give a
new study in the same storage, so that trials measured under other settings are never reused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

from pydantic import Field

from autoshard.config import Engine, Frozen, Hardware, Precision, WorkloadSpec
from autoshard.target.resolve import TargetSpec

# Bumped when what a study stores changes meaning: older studies are then not resumed.
STUDY_FORMAT = "autoshard.study/2"


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
        """Settings in canonical form: the order of precisions or batch sizes does not matter."""
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

    def name(self, candidates: Sequence[str] = ()) -> str:
        """``autoshard-<12 hex digits>``; ``candidates`` (the labels of the candidate set, when
        known) are part of it, so that a version of autoshard that enumerates other candidates
        for the same settings starts a new study rather than mixing two spaces."""
        data = self.model_dump(mode="json")
        # The first size is in micro_batch_sizes already: `--batch-size 2,1` equals `1,2`.
        data["workload"].pop("micro_batch_size", None)
        key = json.dumps([STUDY_FORMAT, data, sorted(candidates)], sort_keys=True)
        return "autoshard-" + hashlib.sha256(key.encode()).hexdigest()[:12]
