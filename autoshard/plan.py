"""THE planning pipeline. Every door (``autoshard.estimate / recommend / tune``, the command line,
export and the reports) goes through here, so the same inputs give the same answer:

    PlanOptions (what the user said: flags or keyword arguments, validated once)
      -> PlanRequest (resolved: target, hardware, workload, engine, precisions, sizes)
      -> make_plan: build on meta, analyse, candidates, activation profile, estimates, the
         step-time model's speed of each, ranking (one order: space.rank_candidates)
      -> autoshard.decide: decide (estimates only) or decide_from_trials (after a study)
      -> Recommendation (one builder: autoshard.decide.build_recommendation)

Every fallback that changes a number (an assumed sequence length, activations guessed because
the forward cannot run on fake tensors, an assumed GPU model) is a :class:`PlanWarning`, raised
through :mod:`warnings` at every door; the command line prints each as one line.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, ValidationError, field_validator

from autoshard.analyze import analyze_model
from autoshard.config import (
    Candidate,
    Engine,
    Frozen,
    Hardware,
    Loop,
    Precision,
    RankOrder,
    WorkloadSpec,
)
from autoshard.errors import ConfigError
from autoshard.predict.activations import ActivationProfile, precisions_of, profile_activations
from autoshard.predict.analytic import estimate_all
from autoshard.predict.calibrate import SpeedModel
from autoshard.results import MemoryEstimate, ModelProfile
from autoshard.space import enumerate_candidates, rank_candidates
from autoshard.target.adapters import to_target
from autoshard.target.resolve import BuiltModel, TargetSpec, build_target
from autoshard.target.step import batch_samples, find_vocab_size
from autoshard.units import format_bytes, parse_size

# Micro-batch sizes tried when neither a batch nor a batch size is given.
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)
# Sequence length assumed for a token model when none is given: its context, at most this.
DEFAULT_SEQ_LEN_CAP = 4096
# The catalogue's entry for CPU worker processes (gloo): planning for them, not for GPUs.
CPU_GLOO_ID = "cpu-gloo"
# CPU worker processes when trials run without a GPU (gloo).
DEFAULT_CPU_WORKERS = 2


class PlanWarning(UserWarning):
    """A number autoshard had to assume or guess: it says which and how to give the real one.

    >>> import warnings
    >>> import autoshard
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = autoshard.estimate("examples/gpt.py:build", kwargs={"size": "tiny"}, gpus=8)
    >>> [str(w.message).split(":")[0] for w in caught if w.category is autoshard.PlanWarning]
    ['no GPU visible and no gpu/gpu_memory given', 'seq_len 256']
    """


class NoGPUWarning(PlanWarning):
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


# --------------------------------------------------------------------------------------------
# What the user said
# --------------------------------------------------------------------------------------------


def _split(value: Any) -> Any:
    """``"1,2,4"`` -> ``["1", "2", "4"]``; lists, tuples and single values pass through."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, int | Precision):
        return [value]
    return value


def _bytes(text: str) -> int:
    """A size for a validator: the message without a flag (the caller names the flag)."""
    try:
        return parse_size(text, flag="\0")
    except ConfigError as exc:
        message = str(exc).replace(f"\0 {text.strip()}: ", "").replace("\0: ", "")
        raise ValueError(message) from None


class PlanOptions(Frozen):
    """What to plan for, as a user says it: keyword arguments of ``autoshard.estimate``,
    ``recommend`` and ``tune``, and the flags of ``autoshard estimate`` and ``autoshard tune``
    (each field is a flag: ``gpu_memory`` is ``--gpu-memory``). Defaults, validation and help
    live here only.

    >>> from autoshard.plan import PlanOptions
    >>> PlanOptions(gpus=8, gpu_memory="80GiB", batch_size="1,2").batch_size
    (1, 2)
    """

    gpus: int | None = Field(
        None,
        ge=1,
        description="GPUs per node to plan for (default: the visible GPUs; for trials without "
        "a GPU, 2 CPU processes).",
    )
    nodes: int = Field(1, ge=1, description="Nodes.")
    gpu: str | None = Field(
        None,
        description="GPU model from the catalogue, e.g. h100-sxm or a100-40gb-pcie: sets memory "
        "and speed (default: the visible GPU's).",
    )
    gpu_memory: int | None = Field(
        None, gt=0, description="Memory of one GPU, e.g. 80GiB (default: the GPU model's)."
    )
    host_memory: int | None = Field(
        None, gt=0, description="Host memory per node, e.g. 1TiB, checked for CPU offload."
    )
    intra_node_bandwidth: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="GPU link inside a node, bytes/s per GPU, e.g. 450GB (per s).",
    )
    inter_node_bandwidth: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Network between nodes, bytes/s per node, e.g. 400GB (per s).",
    )
    seq_len: int | None = Field(
        None,
        ge=1,
        description="Tokens per sample of a token model (default: the example batch's, else the "
        "model's context up to 4096).",
    )
    batch_size: tuple[int, ...] | None = Field(
        None,
        description="Micro-batch sizes per GPU to consider, e.g. 1 or 1,2,4 (default: the "
        "example batch's, else 1,2,4,8).",
    )
    loop: Loop = Field(
        Loop.LIGHTNING,
        description="The training loop: lightning (the Trainer's order: gradients alive through "
        "the next forward) or plain (zero_grad after step).",
    )
    accumulate: int = Field(
        1, ge=1, description="Micro-batches of gradient accumulation per optimizer step."
    )
    engine: Engine = Field(
        Engine.FSDP1,
        description="fsdp1 (Lightning's FSDPStrategy) or fsdp2 (fully_shard, "
        "ModelParallelStrategy).",
    )
    precision: tuple[Precision, ...] | None = Field(
        None,
        description="Pin the precision(s), e.g. bf16-mixed or bf16-mixed,32-true (default: "
        "bf16-mixed where supported, 16-mixed elsewhere, and 32-true).",
    )
    simulate: int = Field(
        0,
        ge=0,
        description="Also simulate the N best fitting candidates: real FSDP on fake tensors, "
        "seconds each, exact to the allocator.",
    )

    @field_validator("gpu_memory", "host_memory", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return _bytes(value) if isinstance(value, str) else value

    @field_validator("intra_node_bandwidth", "inter_node_bandwidth", mode="before")
    @classmethod
    def _rate(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            for suffix in ("/s", "ps"):
                text = text.removesuffix(suffix)
            return float(_bytes(text))
        return value

    @field_validator("batch_size", "precision", mode="before")
    @classmethod
    def _list(cls, value: Any) -> Any:
        return _split(value)

    @field_validator("batch_size")
    @classmethod
    def _positive(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and (not value or min(value) < 1):
            raise ValueError("give positive integers, e.g. 1 or 1,2,4")
        return value

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str | None) -> str | None:
        if value is not None:
            from autoshard.gpus import gpu_spec

            gpu_spec(value)  # a one-line ConfigError listing the ids
        return value


def options_from(model: type[Frozen], values: Mapping[str, Any], *, cli: bool = False) -> Any:
    """Validate ``values`` into ``model``; a mistake becomes one :class:`ConfigError` line that
    names the flag (``--gpu-memory``) or keyword (``gpu_memory=``) and how to fix it."""
    try:
        return model(**values)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, values, cli=cli)) from None


def validation_message(exc: ValidationError, values: Mapping[str, Any], *, cli: bool) -> str:
    """One line for the first error of ``exc``."""
    error = exc.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else ""
    if error["type"] == "extra_forbidden":
        return f"unknown option {name}=; see help(autoshard.PlanOptions) for the options"
    flag = f"--{name.replace('_', '-')}" if cli else f"{name}="
    given = values.get(name, error.get("input"))
    message = str(error["msg"]).removeprefix("Value error, ")
    ctx = error.get("ctx") or {}
    if error["type"] == "enum" and "expected" in ctx:
        choices = str(ctx["expected"]).replace("'", "").replace(" or ", ", ")
        message = f"choose one of {choices}"
    elif error["type"] == "greater_than_equal":
        message = f"give {ctx['ge']} or more"
    elif error["type"] == "greater_than":
        message = f"give more than {ctx['gt']}"
    elif error["type"] == "finite_number":
        message = "give a finite number (inf and nan are not a time or a size)"
    elif error["type"] in ("less_than", "less_than_equal"):
        message = f"give less than {ctx.get('lt', ctx.get('le'))}"
    return f"{flag} {given}: {message}"


# --------------------------------------------------------------------------------------------
# Resolving it
# --------------------------------------------------------------------------------------------


def _visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def detect_hardware(
    options: PlanOptions | None = None, *, trials: bool = False, **values: Any
) -> Hardware:
    """The GPUs to plan for: the options given, the visible GPUs for the rest.

    Without a visible GPU, ``gpus`` must be given for planning (trials run on 2 CPU processes
    unless told otherwise), and the GPU model is the catalogue's default, said in a warning.

    >>> import warnings
    >>> from autoshard import detect_hardware
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     cluster = detect_hardware(gpus=8, gpu_memory="80GiB")
    >>> cluster.world_size, cluster.gpu_memory // 2**30
    (8, 80)
    """
    from autoshard.gpus import DEFAULT_GPU, gpu_spec, match_gpu_name

    opts = options or options_from(PlanOptions, values)
    visible = _visible_gpus()
    gpu_id = opts.gpu
    if gpu_id is None and visible:
        gpu_id = match_gpu_name(torch.cuda.get_device_name(0))
    if gpu_id is None and not visible and opts.gpu_memory is None:
        gpu_id = DEFAULT_GPU
        warnings.warn(
            f"no GPU visible and no gpu/gpu_memory given: planning for {gpu_spec(gpu_id).name}"
            f" ({gpu_id}); give --gpu or --gpu-memory for yours",
            PlanWarning,
            stacklevel=3,
        )
    if opts.gpu_memory is not None:
        memory = opts.gpu_memory
    elif visible and opts.gpu is None:
        memory = torch.cuda.get_device_properties(0).total_memory
    else:
        assert gpu_id is not None
        memory = gpu_spec(gpu_id).memory
    gpus = opts.gpus
    if gpus is None:
        if visible:
            gpus = visible
        elif trials:
            gpus = DEFAULT_CPU_WORKERS
        else:
            raise ConfigError(
                "no GPU visible here: give gpus (--gpus N, GPUs per node) for the GPUs to plan for"
            )
    if not visible:
        warnings.warn(
            f"no GPU visible: planning for {opts.nodes} x {gpus} GPUs of {format_bytes(memory)}"
            + ("; trials run on CPU processes with gloo" if trials else ""),
            NoGPUWarning,
            stacklevel=3,
        )
    return Hardware(
        # The catalogue's CPU entry plans for the CPU processes themselves (gloo, no CUDA
        # allowance): trials then measure what is planned, and their speed decides.
        backend="gloo" if gpu_id == CPU_GLOO_ID else "nccl",
        gpus_per_node=gpus,
        nodes=opts.nodes,
        gpu_memory=memory,
        host_memory=opts.host_memory,
        bf16_supported=torch.cuda.is_bf16_supported() if visible else True,
        gpu=gpu_id,
        intra_node_bandwidth=opts.intra_node_bandwidth,
        inter_node_bandwidth=opts.inter_node_bandwidth,
    )


class PlanRequest(Frozen):
    """A resolved request: everything :func:`make_plan` needs, nothing left to guess."""

    target: TargetSpec
    label: str = Field("", description="What the model is called in reports.")
    hardware: Hardware
    options: PlanOptions


def make_request(
    model: Any,
    options: PlanOptions,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    out_dir: Path | None = None,
    trials: bool = False,
    hardware: Hardware | None = None,
) -> PlanRequest:
    """Resolve ``model`` (anything :func:`autoshard.target.adapters.to_target` takes: a target
    string, a factory, a module, a LightningModule, a Hugging Face model) and the hardware."""
    target = to_target(model, kwargs=kwargs, batch=batch, out_dir=out_dir)
    return PlanRequest(
        target=target,
        label=_label(model, target),
        hardware=hardware or detect_hardware(options, trials=trials),
        options=options,
    )


def _label(model: Any, target: TargetSpec) -> str:
    if isinstance(model, str):
        return str(target) if not model else " ".join([model, *_kwargs_text(target)])
    if isinstance(model, TargetSpec):
        return str(model)
    if isinstance(model, torch.nn.Module):
        return f"{type(model).__module__}.{type(model).__qualname__}"
    return str(target)


def _kwargs_text(target: TargetSpec) -> list[str]:
    inner = target.kwargs.get("kwargs") if "factory" in target.kwargs else target.kwargs
    return [f"{k}={v!r}" for k, v in dict(inner or {}).items()]


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """A model analysed and every candidate estimated, ranked fastest predicted first."""

    request: PlanRequest
    built: BuiltModel
    profile: ModelProfile
    workload: WorkloadSpec
    candidates: tuple[Candidate, ...]
    activations: ActivationProfile
    estimates: tuple[MemoryEstimate, ...]
    speed: SpeedModel
    notes: tuple[str, ...] = field(default=())

    @property
    def hardware(self) -> Hardware:
        return self.request.hardware

    def ranked(self, order: RankOrder | str = RankOrder.SPEED) -> list[MemoryEstimate]:
        """Fitting candidates first (fastest predicted, or most headroom), then the rest by
        how far they overshoot."""
        return rank_candidates(self.estimates, order)


def make_plan(request: PlanRequest) -> Plan:
    """Analyse the model, enumerate candidates, profile activations and estimate them all."""
    opts = request.options
    built = build_target(request.target)
    profile = analyze_model(
        built.model, target=request.label or str(request.target), built_on=built.built_on,
        extra_warnings=built.warnings,
    )  # fmt: skip
    workload, notes = resolve_workload(built, opts, request.label or str(request.target))
    candidates = enumerate_candidates(
        profile,
        request.hardware,
        workload,
        engine=opts.engine,
        precisions=opts.precision,
        micro_batch_sizes=micro_batch_sizes(built, opts),
    )
    activations = profile_activations(
        built.model, profile, workload, batch=built.batch, precisions=precisions_of(candidates)
    )
    if activations.note:
        notes.append(activations.note)
    speed = SpeedModel.build(profile, built.model, request.hardware, workload, batch=built.batch)
    if speed.flops.note:
        notes.append(speed.flops.note)
    if speed.note:
        notes.append(speed.note)
    estimates = speed.attach(
        estimate_all(profile, candidates, request.hardware, workload, activations=activations)
    )
    if opts.simulate:
        from autoshard.predict.simulate import refine_with_simulation

        simulated = refine_with_simulation(
            request.target, rank_candidates(estimates), request.hardware, workload,
            block_classes=profile.block_classes, count=opts.simulate,
        )  # fmt: skip
        estimates = speed.attach(simulated)  # simulated peaks can change fit and headroom
    estimates = rank_candidates(estimates)
    for note in notes:
        warnings.warn(note, PlanWarning, stacklevel=2)
    return Plan(
        request=request,
        built=built,
        profile=profile,
        workload=workload,
        candidates=tuple(candidates),
        activations=activations,
        estimates=tuple(estimates),
        speed=speed,
        notes=tuple(notes),
    )


def micro_batch_sizes(built: BuiltModel, options: PlanOptions) -> tuple[int, ...]:
    """The sizes asked for, the example batch's, or 1, 2, 4, 8."""
    if options.batch_size is not None:
        return options.batch_size
    if built.batch is not None:
        return (batch_samples(built.batch),)
    return DEFAULT_MICRO_BATCH_SIZES


def resolve_workload(
    built: BuiltModel, options: PlanOptions, source: str = "the target"
) -> tuple[WorkloadSpec, list[str]]:
    """The workload of one step, and a note for every number that was assumed.

    A batch that ``source`` returns is used as built (its FLOPs and activations are counted on
    it), so a ``seq_len`` that contradicts its token length is an error: counted at one length
    and reported at the other, the tokens/s and the memory would belong to different steps."""
    notes: list[str] = []
    vocab = find_vocab_size(built.model)
    seq_len = options.seq_len
    built_len = _batch_seq_len(built.batch) if built.batch is not None else None
    if seq_len is not None and built_len is not None and seq_len != built_len:
        raise ConfigError(
            f"seq_len {seq_len} but the batch {source} returns has {built_len} tokens per "
            f"sample, and that batch is what is measured: build it with {seq_len} (e.g. --arg "
            f"seq_len={seq_len}, or kwargs={{'seq_len': {seq_len}}} in code) or leave out "
            "--seq-len / seq_len="
        )
    if seq_len is None:
        seq_len = built_len
    if seq_len is None and vocab is not None:
        context = _context_length(built.model)
        seq_len = min(context or DEFAULT_SEQ_LEN_CAP, DEFAULT_SEQ_LEN_CAP)
        origin = f"the model's context ({context})" if context else "assumed"
        capped = " capped" if context and context > seq_len else ""
        notes.append(f"seq_len {seq_len}: {origin}{capped}; give --seq-len / seq_len= for yours")
    workload = WorkloadSpec(
        micro_batch_size=micro_batch_sizes(built, options)[0],
        seq_len=seq_len,
        vocab_size=vocab,
        loop=options.loop,
        accumulate=options.accumulate,
    )
    return workload, notes


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
