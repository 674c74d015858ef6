"""``autoshard.recommend(model)``: the FSDP configuration for a model, from Python.

With ``trials=0`` (the default) the answer rests on the analyzer and the memory estimator and
comes back in seconds, with no GPU and no real memory. With ``trials > 0`` short real FSDP runs
measure the promising candidates (:func:`autoshard.search.tune`) and the fastest that fits wins.

What can be planned for: a model object (real or on the meta device), a Hugging Face model, a
LightningModule, a factory function or class, or a ``"path/to/file.py:build"`` target; see
:mod:`autoshard.target.adapters`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from autoshard.analyze import analyze_model
from autoshard.config import Candidate, Engine, Hardware, Precision, WorkloadSpec
from autoshard.errors import ConfigError
from autoshard.predict.activations import ActivationProfile, precisions_of, profile_activations
from autoshard.predict.analytic import estimate_all
from autoshard.predict.simulate import refine_with_simulation
from autoshard.results import MemoryEstimate, ModelProfile, Recommendation, Scored
from autoshard.space import (
    check_rank_order,
    enumerate_candidates,
    rank_candidates,
    wrap_reason,
)
from autoshard.target.adapters import to_target
from autoshard.target.resolve import BuiltModel, TargetSpec, build_target
from autoshard.target.step import batch_samples, find_vocab_size
from autoshard.units import format_bytes, parse_size

__all__ = ["NoGPUWarning", "detect_hardware", "estimate", "recommend"]

# Micro-batch sizes tried when neither a batch nor a batch size is given.
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)
# Sequence length assumed for a token model when none is given: its context, at most this.
DEFAULT_SEQ_LEN_CAP = 4096


class NoGPUWarning(UserWarning):
    """No CUDA GPU is visible: trials run on CPU processes, and the GPUs are the ones given.

    Silence it where planning for GPUs that are not at hand is the point:

    >>> import warnings
    >>> from autoshard import NoGPUWarning, detect_hardware
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", NoGPUWarning)
    ...     cluster = detect_hardware(gpus=8, nodes=4, gpu_memory="80GiB")
    >>> cluster.world_size
    32
    """


def detect_hardware(
    *,
    gpus: int | None = None,
    nodes: int = 1,
    gpu_memory: int | str | None = None,
    host_memory: int | str | None = None,
) -> Hardware:
    """The GPUs to plan for: the arguments given, the visible GPUs for the rest.

    Without a visible GPU, ``gpu_memory`` must be given (a :class:`ConfigError` says so) and a
    :class:`NoGPUWarning` says that trials run on CPU processes.

    >>> from autoshard import detect_hardware
    >>> detect_hardware(gpus=8, gpu_memory="80GiB").world_size
    8
    """
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if isinstance(gpu_memory, str):
        gpu_memory = parse_size(gpu_memory, flag="gpu_memory")
    if isinstance(host_memory, str):
        host_memory = parse_size(host_memory, flag="host_memory")
    if gpu_memory is None:
        if not has_gpu:
            raise ConfigError(
                "no GPU visible here: give gpu_memory (e.g. gpu_memory='80GiB') and gpus for "
                "the GPUs to plan for; trials then run on CPU processes (gloo)"
            )
        gpu_memory = torch.cuda.get_device_properties(0).total_memory
    if gpus is None:
        if not has_gpu:
            raise ConfigError(
                "no GPU visible here: give gpus (GPUs per node) for the GPUs to plan for"
            )
        gpus = torch.cuda.device_count()
    if not has_gpu:
        warnings.warn(
            f"no GPU visible: planning for {nodes} x {gpus} GPUs of "
            f"{format_bytes(gpu_memory)}; trials (if any) run on CPU processes with gloo",
            NoGPUWarning,
            stacklevel=2,
        )
    bf16 = torch.cuda.is_bf16_supported() if has_gpu else True
    return Hardware(
        gpus_per_node=gpus,
        nodes=nodes,
        gpu_memory=gpu_memory,
        host_memory=host_memory,
        bf16_supported=bf16,
    )


def recommend(
    model: Any,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    gpus: int | None = None,
    nodes: int = 1,
    gpu_memory: int | str | None = None,
    host_memory: int | str | None = None,
    seq_len: int | None = None,
    batch_size: int | Sequence[int] | None = None,
    engine: Engine | str = Engine.FSDP1,
    precision: Precision | str | Sequence[Precision | str] | None = None,
    trials: int = 0,
    out_dir: str | Path | None = None,
    nproc: int | None = None,
    trial_timeout: float = 300.0,
    warmup: int = 2,
    steps: int = 3,
) -> Recommendation:
    """Recommend the FSDP configuration for ``model`` on ``gpus`` x ``nodes`` GPUs.

    Args:
        model: an ``nn.Module`` (real or meta), a Hugging Face model, a LightningModule, a
            factory (function or class) that returns a model or ``(model, batch)``, or a target
            string ``"path/to/file.py:build"``.
        kwargs: keyword arguments of the factory.
        batch: an example training batch (a dict is passed as keyword arguments, a tuple as
            positional ones; Hugging Face models get ``labels`` and return ``.loss``).
        gpus, nodes, gpu_memory, host_memory: the cluster to plan for (sizes as bytes or
            "80GiB"); default: the visible GPUs.
        seq_len: tokens per sample of a token model (default: from the batch, else the model's
            context length up to 4096).
        batch_size: micro-batch size(s) per GPU to consider (default: the batch's, else 1-8).
        engine: "fsdp1" (Lightning's FSDPStrategy) or "fsdp2" (ModelParallelStrategy).
        precision: pin one precision or several ("bf16-mixed", "32-true", ...).
        trials: 0 decides from estimates alone (seconds); N > 0 runs up to N short real trials.
        out_dir: where trials write their study, logs and reports (default "autoshard-out").
        nproc, trial_timeout, warmup, steps: how trials run (processes per node: the visible
            GPUs, or 2 CPU processes).

    Returns:
        A :class:`Recommendation`: ``rec.chosen.candidate`` is the configuration,
        ``rec.reasons`` says why each setting, ``rec.runners_up`` / ``rec.ruled_out`` the rest.

    Example (runs on a CPU in a few seconds)::

        >>> import torch
        >>> from torch import nn
        >>> from autoshard.api import recommend
        >>> layers = [nn.TransformerEncoderLayer(256, 4, batch_first=True) for _ in range(4)]
        >>> rec = recommend(nn.Sequential(*layers), batch=torch.randn(2, 128, 256),
        ...                 gpus=8, gpu_memory="80GiB")
        >>> rec.chosen.candidate.wrap_classes
        ('torch.nn.modules.transformer.TransformerEncoderLayer',)
    """
    if trials < 0:
        raise ConfigError(f"trials must be 0 (estimate only) or more, got {trials}")
    hardware = detect_hardware(
        gpus=gpus, nodes=nodes, gpu_memory=gpu_memory, host_memory=host_memory
    )
    engine = _engine(engine)
    precisions = _precisions(precision)
    out = Path(out_dir) if out_dir is not None else None
    target = to_target(model, kwargs=kwargs, batch=batch, out_dir=out)
    built = build_target(target)
    workload, notes = _workload(built, seq_len=seq_len, batch_size=batch_size)
    sizes = _sizes(built, batch_size)

    if trials > 0:
        return _tune(
            target,
            hardware,
            workload,
            out=out or Path("autoshard-out"),
            trials=trials,
            engine=engine,
            precisions=precisions,
            sizes=sizes,
            nproc=nproc,
            trial_timeout=trial_timeout,
            warmup=warmup,
            steps=steps,
        )

    profile, activations, estimates = _estimate_all_candidates(
        model, target, built, hardware, workload, engine=engine, precisions=precisions,
        sizes=sizes,
    )  # fmt: skip
    if activations.note:
        notes.append(activations.note)
    return choose_by_estimate(profile, estimates, hardware, workload, notes=notes)


def _estimate_all_candidates(
    model: Any,
    target: TargetSpec,
    built: BuiltModel,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    engine: Engine,
    precisions: tuple[Precision, ...] | None,
    sizes: tuple[int, ...],
) -> tuple[ModelProfile, ActivationProfile, list[MemoryEstimate]]:
    """Analyse the built model, profile its activations and estimate every candidate."""
    profile = analyze_model(
        built.model, target=_label(model, target), built_on=built.built_on,
        extra_warnings=built.warnings,
    )  # fmt: skip
    candidates = enumerate_candidates(
        profile, hardware, workload, engine=engine, precisions=precisions, micro_batch_sizes=sizes
    )
    activations = profile_activations(
        built.model, profile, workload, batch=built.batch, precisions=precisions_of(candidates)
    )
    estimates = estimate_all(profile, candidates, hardware, workload, activations=activations)
    return profile, activations, estimates


def estimate(
    model: Any,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    gpus: int | None = None,
    nodes: int = 1,
    gpu_memory: int | str | None = None,
    host_memory: int | str | None = None,
    seq_len: int | None = None,
    batch_size: int | Sequence[int] | None = None,
    engine: Engine | str = Engine.FSDP1,
    precision: Precision | str | Sequence[Precision | str] | None = None,
    simulate: int = 0,
    sort: str = "headroom",
) -> list[MemoryEstimate]:
    """Predict the per-GPU and host memory of every FSDP candidate for ``model``: the fitting
    ones first, the most headroom first (as ``autoshard estimate`` prints them), or the fastest
    expected first with ``sort="speed"``.

    Takes the same model and cluster arguments as :func:`recommend`. ``simulate=N`` replaces
    the analytic estimates of the N best fitting candidates with simulated ones (real FSDP on
    fake tensors: seconds each). Each estimate has ``gpu_peak``, ``host_peak``, ``fits``,
    ``peak_at`` and a ``breakdown`` by kind.

    Example (runs on a CPU in a few seconds)::

        >>> import autoshard
        >>> estimates = autoshard.estimate("examples/gpt.py:build", kwargs={"size": "tiny"},
        ...                                gpus=8, gpu_memory="24GiB", seq_len=128)
        >>> roomiest = estimates[0]
        >>> roomiest.fits, roomiest.candidate.cpu_offload  # offload leaves the most GPU memory
        (True, True)
        >>> fastest = autoshard.estimate("examples/gpt.py:build", kwargs={"size": "tiny"},
        ...                              gpus=8, gpu_memory="24GiB", seq_len=128, sort="speed")[0]
        >>> fastest.fits, fastest.breakdown.optimizer > 0
        (True, True)
    """
    if simulate < 0:
        raise ConfigError(f"simulate must be 0 or a number of candidates, got {simulate}")
    check_rank_order(sort, "sort")
    hardware = detect_hardware(
        gpus=gpus, nodes=nodes, gpu_memory=gpu_memory, host_memory=host_memory
    )
    target = to_target(model, kwargs=kwargs, batch=batch, out_dir=None)
    built = build_target(target)
    workload, _ = _workload(built, seq_len=seq_len, batch_size=batch_size)
    profile, _, estimates = _estimate_all_candidates(
        model, target, built, hardware, workload, engine=_engine(engine),
        precisions=_precisions(precision), sizes=_sizes(built, batch_size),
    )  # fmt: skip
    ranked = rank_candidates(estimates, device="cuda")
    if simulate:
        ranked = refine_with_simulation(
            target, ranked, hardware, workload, block_classes=profile.block_classes,
            count=simulate,
        )  # fmt: skip
    return rank_candidates(ranked, device="cuda", by=sort)


def choose_by_estimate(
    profile: ModelProfile,
    estimates: Sequence[MemoryEstimate],
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    notes: Sequence[str] = (),
) -> Recommendation:
    """The fitting candidate expected to be fastest, with one reason per setting."""
    ranked = rank_candidates(estimates, device="cuda")
    fitting = [e for e in ranked if e.fits]
    if not fitting:
        closest = ranked[0] if ranked else None
        detail = f"; closest: {closest.candidate.label()} ({closest.reason})" if closest else ""
        raise ConfigError(
            f"no configuration fits {hardware.world_size} x {format_bytes(hardware.gpu_memory)} "
            f"GPUs ({len(estimates)} estimated){detail}; add GPUs or nodes, or use a smaller "
            "micro-batch or sequence"
        )
    best = fitting[0]
    return Recommendation(
        profile=profile,
        hardware=hardware,
        workload=workload,
        chosen=Scored(candidate=best.candidate, estimate=best),
        runners_up=tuple(Scored(candidate=e.candidate, estimate=e) for e in fitting[1:5]),
        ruled_out=tuple(Scored(candidate=e.candidate, estimate=e) for e in ranked if not e.fits),
        basis="estimate",
        reasons=tuple(explain_estimate(best, estimates, profile, hardware) + list(notes)),
        versions=_versions(),
    )


# --------------------------------------------------------------------------------------------
# Reasons: one line per chosen setting, from the estimates of its alternatives
# --------------------------------------------------------------------------------------------

_SETTINGS = ("sharding", "checkpointing", "cpu_offload", "precision", "micro_batch_size")


def _value(candidate: Candidate, name: str) -> str:
    value = getattr(candidate, name)
    if name == "checkpointing" and candidate.checkpointing.value == "every_k":
        return f"every {candidate.checkpoint_every} blocks"
    return str(getattr(value, "value", value))


def _differs_only_in(a: Candidate, b: Candidate, name: str) -> bool:
    related = {
        "sharding": {"sharding", "hybrid_mesh"},
        "checkpointing": {"checkpointing", "checkpoint_every", "checkpoint_classes"},
    }.get(name, {name})
    da, db = a.model_dump(), b.model_dump()
    return da != db and all(da[k] == db[k] for k in da if k not in related)


def explain_estimate(
    best: MemoryEstimate,
    estimates: Sequence[MemoryEstimate],
    profile: ModelProfile,
    hardware: Hardware,
) -> list[str]:
    """Why each setting of ``best``: what its alternatives would need, or cost."""
    c = best.candidate
    usable = format_bytes(hardware.usable_gpu_memory)
    b = best.breakdown
    lines = [
        f"predicted peak {format_bytes(best.gpu_peak)} per GPU of {usable} usable "
        f"({hardware.world_size} x {format_bytes(hardware.gpu_memory)}, "
        f"{hardware.margin:.0%} margin): params {format_bytes(b.sharded_params)}, "
        f"grads {format_bytes(b.gradients)}, optimizer {format_bytes(b.optimizer)}, "
        f"gathered units {format_bytes(b.unsharded_params)}, activations "
        f"{format_bytes(b.activations)}, temporaries {format_bytes(b.temporaries)}, "
        f"allowance {format_bytes(b.allowance)}",
        wrap_reason(c, profile),
    ]
    if profile.tied:
        names = "; ".join(", ".join(g.names) for g in profile.tied)
        lines.append(f"tied parameters ({names}) stay in one FSDP unit (the root)")
    for name in _SETTINGS:
        alternatives = [e for e in estimates if _differs_only_in(e.candidate, c, name)]
        chosen = _value(c, name)
        too_big = sorted(
            {f"{_value(e.candidate, name)} ({format_bytes(e.gpu_peak)})" for e in alternatives
             if not e.fits}
        )  # fmt: skip
        slower = sorted({_value(e.candidate, name) for e in alternatives if e.fits})
        parts = []
        if too_big:
            parts.append(f"does not fit with {', '.join(too_big)}")
        if slower:
            parts.append(f"fits but expected slower with {', '.join(slower)}")
        why = "; ".join(parts) or (
            "offload is considered with FULL_SHARD only"
            if name == "cpu_offload"
            else "the only value considered (pass batch_size= to compare others)"
            if name == "micro_batch_size"
            else "the only value considered"
        )
        if name == "checkpointing" and c.checkpoint_classes:
            chosen += f" of {{{', '.join(c.checkpoint_classes)}}}"
        lines.append(f"{name} {chosen}: {why}")
    lines.append(
        f"limit_all_gathers={c.limit_all_gathers}, forward_prefetch={c.forward_prefetch}, "
        f"backward_prefetch={c.backward_prefetch.value}, {c.optimizer.value} "
        f"({c.optimizer_impl.value}): Lightning's defaults; they change speed a little, "
        "memory by at most one unit; measure them with trials"
    )
    lines.append(
        "basis: estimates only (no trial ran); run recommend(..., trials=N) to measure the "
        "leading candidates"
    )
    return lines


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _engine(engine: Engine | str) -> Engine:
    try:
        return Engine(engine)
    except ValueError:
        raise ConfigError(f"engine must be fsdp1 or fsdp2, got {engine!r}") from None


def _precisions(
    precision: Precision | str | Sequence[Precision | str] | None,
) -> tuple[Precision, ...] | None:
    if precision is None:
        return None
    items = [precision] if isinstance(precision, str | Precision) else list(precision)
    out = []
    for p in items:
        try:
            out.append(Precision(p))
        except ValueError:
            names = ", ".join(x.value for x in Precision)
            raise ConfigError(f"precision must be one of {names}, got {p!r}") from None
    return tuple(out)


def _sizes(built: BuiltModel, batch_size: int | Sequence[int] | None) -> tuple[int, ...]:
    if batch_size is not None:
        sizes = (batch_size,) if isinstance(batch_size, int) else tuple(batch_size)
        if not sizes or any(s < 1 for s in sizes):
            raise ConfigError(f"batch_size must be positive, got {batch_size!r}")
        return sizes
    if built.batch is not None:
        return (batch_samples(built.batch),)
    return DEFAULT_MICRO_BATCH_SIZES


def _workload(
    built: BuiltModel, *, seq_len: int | None, batch_size: int | Sequence[int] | None
) -> tuple[WorkloadSpec, list[str]]:
    notes: list[str] = []
    vocab = find_vocab_size(built.model)
    if seq_len is None and built.batch is not None:
        seq_len = _batch_seq_len(built.batch)
    if seq_len is None and vocab is not None:
        context = _context_length(built.model)
        seq_len = min(context or DEFAULT_SEQ_LEN_CAP, DEFAULT_SEQ_LEN_CAP)
        notes.append(
            f"seq_len {seq_len}: "
            + (f"the model's context ({context})" if context else "assumed")
            + f"{' capped' if context and context > seq_len else ''}; pass seq_len= for yours"
        )
    sizes = _sizes(built, batch_size)
    return WorkloadSpec(micro_batch_size=sizes[0], seq_len=seq_len, vocab_size=vocab), notes


def _batch_seq_len(batch: Any) -> int | None:
    first = batch
    if isinstance(batch, Mapping):
        first = batch.get("input_ids", batch.get("decoder_input_ids"))
    elif isinstance(batch, list | tuple) and batch:
        first = batch[0]
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None


def _context_length(model: Any) -> int | None:
    inner = getattr(model, "module", model)  # LightningStep
    for holder in (inner, getattr(inner, "config", None), getattr(inner, "model", None)):
        for name in ("max_seq_len", "max_position_embeddings", "n_positions", "block_size"):
            value = getattr(holder, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _label(model: Any, target: TargetSpec) -> str:
    if isinstance(model, str | TargetSpec):
        return str(target)
    if isinstance(model, torch.nn.Module):
        return f"{type(model).__module__}.{type(model).__qualname__}"
    return str(target)


def _versions() -> dict[str, str]:
    out: dict[str, str] = {"torch": str(torch.__version__)}
    for name in ("autoshard", "transformers", "lightning"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def _tune(
    target: TargetSpec,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    out: Path,
    trials: int,
    engine: Engine,
    precisions: tuple[Precision, ...] | None,
    sizes: tuple[int, ...],
    nproc: int | None,
    trial_timeout: float,
    warmup: int,
    steps: int,
) -> Recommendation:
    from autoshard.search import TuneOptions, tune

    options = TuneOptions(
        out_dir=out,
        n_trials=trials,
        engine=engine,
        precisions=precisions,
        micro_batch_sizes=sizes,
        nproc=nproc,
        trial_timeout=trial_timeout,
        warmup=warmup,
        steps=steps,
    )
    return tune(target, hardware, workload, options)
