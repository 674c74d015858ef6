"""autoshard's answer as the user holds it: :class:`Recommendation`, a
:class:`~autoshard.results.Decision` with doors to what ``emit`` and ``ui`` make of it, and
:func:`load_result`, which reads one back from what ``tune`` or ``estimate`` wrote.

It stands a floor above ``emit`` and ``ui``: they take the data (``Decision``) and never import
this module, so the imports run one way (tests/test_imports.py holds them to it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from autoshard.errors import ResultError
from autoshard.results import Decision, TrialResult


class Recommendation(Decision):
    """autoshard's answer: the chosen configuration, its evidence, and the alternatives.

    One call per stack applies the whole configuration (wrapping, sharding, mixed precision,
    offload, prefetch *and* activation checkpointing):

    - plain torch: ``model = rec.apply(model)`` (FSDP1 or FSDP2, on this rank's device);
      ``rec.fsdp_kwargs()`` + ``rec.apply_checkpointing(model)`` or ``rec.fsdp2_plan()`` for
      those who wrap themselves;
    - Lightning Trainer: ``Trainer(strategy=rec.strategy(), **rec.trainer_kwargs())``, or
      ``rec.to_yaml("lightning")`` for LightningCLI;
    - Lightning Fabric: ``Fabric(strategy=rec.strategy(fabric=True), **rec.trainer_kwargs())``;
    - accelerate: ``rec.to_yaml("accelerate")`` (``accelerate launch --config_file``);
    - Hugging Face Trainer: ``TrainingArguments(output_dir, **rec.trainer_arguments())``, or
      ``rec.to_yaml("hf-trainer")``.

    What a stack cannot express as chosen (every-k checkpointing in accelerate, say) is said in
    the output, with the closest faithful setting used. ``autoshard.load(path)`` reads one back
    from what ``tune`` or ``estimate --json`` wrote.

    >>> import warnings
    >>> import torch
    >>> from torch import nn
    >>> import autoshard
    >>> warnings.simplefilter("ignore", autoshard.NoGPUWarning)  # planning for GPUs not here
    >>> layers = [nn.TransformerEncoderLayer(64, 4, 128, batch_first=True) for _ in range(4)]
    >>> rec = autoshard.recommend(nn.Sequential(*layers), batch=torch.randn(2, 32, 64),
    ...                           gpus=8, gpu_memory="80GiB")
    >>> rec.basis, rec.trainer_kwargs()  # a toy's step is host-bound: autocast only costs there
    ('estimate', {'precision': '32-true', 'devices': 8, 'num_nodes': 1})
    >>> rec.fsdp_kwargs()["use_orig_params"]  # torch's FullyShardedDataParallel(**kwargs)
    True
    >>> print(rec.to_yaml("lightning").split("trainer:")[1].splitlines()[2].strip())
    class_path: lightning.pytorch.strategies.FSDPStrategy
    >>> args = rec.trainer_arguments()  # Hugging Face TrainingArguments(output_dir, **args)
    >>> args["fsdp"], args["per_device_train_batch_size"]
    (True, 2)
    """

    # Thin doors to autoshard.emit (imported lazily: it needs torch, and lightning for some).
    def apply(self, model: object) -> object:
        """``model`` with the whole configuration applied as the trials applied it (FSDP1
        wrapping then checkpointing, or FSDP2's checkpointing then ``fully_shard``), on this
        rank's CUDA device or, without one, the CPU (gloo); returns the model to train. Needs
        ``torch.distributed.init_process_group()`` first."""
        from autoshard import emit

        return emit.apply(self, model)  # type: ignore[arg-type]

    def optimizer(self, params: object, lr: float) -> object:
        """The optimizer the trials built (class, arguments, foreach / fused / for-loop) over
        ``params``, the parameters of the model ``rec.apply`` returned, with your ``lr``."""
        from autoshard import emit

        return emit.optimizer(self, params, lr=lr)  # type: ignore[arg-type]

    def autocast(self) -> object:
        """The ``torch.autocast`` context the trials ran each forward and loss under."""
        from autoshard import emit

        return emit.autocast(self)

    def strategy(self, model: object = None, *, fabric: bool = False) -> object:
        """A constructed Lightning FSDPStrategy (FSDP1) or ModelParallelStrategy (FSDP2);
        ``fabric=True``: Lightning Fabric's (``lightning.fabric.strategies``)."""
        from autoshard import emit

        return emit.strategy(self, model=model, fabric=fabric)  # type: ignore[arg-type]

    def trainer_kwargs(self) -> dict[str, object]:
        """Trainer (or Fabric) arguments to pass with strategy(): precision, devices, num_nodes."""
        from autoshard import emit

        return emit.trainer_kwargs(self)

    def trainer_arguments(self) -> dict[str, object]:
        """Keyword arguments of Hugging Face's ``TrainingArguments``: ``fsdp``, ``fsdp_config``
        (checkpointing included) and ``bf16`` / ``fp16``. What the Trainer cannot express as
        chosen is an :class:`~autoshard.errors.HandoverNotice` and a note in ``fsdp_config``."""
        from autoshard import emit

        return emit.trainer_arguments(self)

    def fsdp_kwargs(self, device: object = None, model: object = None) -> dict[str, object]:
        """Keyword arguments for torch's FullyShardedDataParallel (FSDP1 engine), on this rank's
        device by default (the CPU where there is no GPU). They do not checkpoint:
        checkpointing is ``rec.apply``'s or ``rec.apply_checkpointing``'s job."""
        from autoshard import emit

        return emit.fsdp_kwargs(self, device=device, model=model)  # type: ignore[arg-type]

    def apply_checkpointing(self, model: object) -> object:
        """Checkpoint the chosen blocks of ``model`` (FSDP1: after wrapping with fsdp_kwargs)."""
        from autoshard import emit

        return emit.apply_checkpointing(model, self)  # type: ignore[arg-type]

    def fsdp2_plan(self) -> object:
        """A function plan(model, mesh=None) applying checkpointing + fully_shard as chosen."""
        from autoshard import emit

        return emit.fsdp2_plan(self)

    def to_yaml(self, fmt: str = "lightning") -> str:
        """The recommendation in ``fmt``, a format of :data:`autoshard.emit.FORMATS` (one row
        each: "lightning" is Lightning CLI YAML; ``autoshard export --help`` lists them)."""
        from autoshard import emit

        return emit.render(self, fmt)

    # Notebooks and rich (``str`` and ``repr``, a few lines, come with the data).
    def __rich__(self) -> object:
        from autoshard.ui.report import summary_renderable

        return summary_renderable(self)

    def _repr_html_(self) -> str:
        from autoshard.ui.html import recommendation_html

        return recommendation_html(self)


# ---------------------------------------------------------------------------------------------
# Reading one back
# ---------------------------------------------------------------------------------------------


def load(path: Path | str) -> Recommendation:
    """The :class:`Recommendation` that ``tune`` or ``estimate`` wrote: a ``tune`` output folder,
    its ``recommendation.json`` or ``report.json``, or the output of ``estimate --json``.

    >>> import autoshard
    >>> try:
    ...     autoshard.load("no-such-folder")
    ... except autoshard.AutoshardError as error:
    ...     print(error)
    no-such-folder: no such file or folder
    """
    return load_result(path)[0]


def load_result(path: Path | str) -> tuple[Recommendation, list[TrialResult]]:
    """Read what ``tune`` or ``estimate`` wrote: an output folder (report.json, or
    recommendation.json + the records of its study in trials.jsonl) or one of those JSON
    files. Reading never chooses: an ``estimate --json`` output carries the pipeline's
    decision."""
    p = Path(path)
    if p.is_dir():
        for name in ("report.json", "recommendation.json"):
            if (p / name).is_file():
                return load_result(p / name)
        raise ResultError(f"{p}: no report.json or recommendation.json here; run `autoshard tune`")
    if not p.is_file():
        raise ResultError(f"{p}: no such file or folder")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultError(f"{p}: not a JSON result ({exc})") from None
    try:
        return _from_json(data, p)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ResultError(f"{p}: not an autoshard result ({where}: {first['msg']})") from None


def _from_json(data: Any, p: Path) -> tuple[Recommendation, list[TrialResult]]:
    if not isinstance(data, dict):
        raise ResultError(f"{p}: not an autoshard result (a JSON object is expected)")
    if "schema" in data:
        _check_schema(data["schema"], p)
        if data.get("recommendation") is None:
            error = data.get("error") or "no configuration ran"
            raise ResultError(f"{p}: the study ended without a recommendation: {error}")
        rec = Recommendation.model_validate(data["recommendation"])
        return rec, [TrialResult.model_validate(t) for t in data.get("trials", [])]
    if "chosen" in data and "profile" in data:
        rec = Recommendation.model_validate(data)
        return rec, _read_trials(p.with_name("trials.jsonl"), rec.study)
    if "estimates" in data:
        return _from_estimates(data, p), []
    raise ResultError(f"{p}: not an autoshard result (from `tune` or `estimate --json`)")


def _check_schema(schema: Any, p: Path) -> None:
    """One line for a report of a schema this autoshard does not read (a newer autoshard's, or
    not a schema at all): its keys may mean something else."""
    from autoshard.ui.report import SCHEMA

    if schema == SCHEMA:
        return
    raise ResultError(
        f"{p}: schema {json.dumps(schema)[:60]} is not one this autoshard reads ({SCHEMA}); "
        "read it with the autoshard that wrote it, or run `autoshard tune` again with this one"
    )


def _read_trials(path: Path, study: str | None) -> list[TrialResult]:
    """The recommendation's own trials: one folder may hold the records of several studies
    (tuned again with other settings); a recommendation without a study name (older) reads all."""
    from autoshard.study.journal import read_records

    return read_records(path, study, error=ResultError)


def _from_estimates(data: dict[str, Any], p: Path) -> Recommendation:
    """``estimate --json``: the pipeline's decision that it carries (the same as ``recommend()``
    for the same inputs); never a choice made here."""
    if "recommendation" not in data:
        raise ResultError(
            f"{p}: this estimate JSON carries no recommendation (written by an older "
            "autoshard); run `autoshard estimate --json` again"
        )
    if data["recommendation"] is None:
        raise ResultError(f"{p}: no candidate fits in this estimate; nothing to export")
    return Recommendation.model_validate(data["recommendation"])
