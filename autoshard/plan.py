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

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, ValidationError, ValidationInfo, field_validator

from autoshard.analyze import analyze_model, find_context
from autoshard.config import (
    OPTIMIZER_TRAITS,
    Candidate,
    Engine,
    Frozen,
    Hardware,
    Loop,
    Optimizer,
    Precision,
    RankOrder,
    WorkloadSpec,
    document_fields,
)
from autoshard.errors import ConfigError
from autoshard.predict.activations import ActivationProfile, precisions_of, profile_activations
from autoshard.predict.analytic import compile_saving, estimate_all
from autoshard.predict.attention_kernels import attention_device
from autoshard.predict.calibrate import SpeedModel
from autoshard.results import MemoryEstimate, ModelProfile
from autoshard.space import (
    BF16_COMPUTE,
    default_precisions,
    enumerate_candidates,
    float8_blocker,
    rank_candidates,
)
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


# The most micro-batches a step may accumulate: the estimate keeps a list per micro-batch
# (1,000,000 grew to 6.5 GB, 99,999,999,999 a MemoryError), and a trial runs them all per step.
MAX_ACCUMULATE = 4096


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
        1,
        ge=1,
        le=MAX_ACCUMULATE,
        description="Micro-batches of gradient accumulation per optimizer step.",
    )
    engine: Engine = Field(
        Engine.FSDP1,
        description="fsdp1 (Lightning's FSDPStrategy) or fsdp2 (fully_shard, "
        "ModelParallelStrategy).",
    )
    optimizer: Optimizer = Field(
        Optimizer.ADAMW,
        description="The optimizer the training step runs, every candidate with it: its states "
        "and passes over memory are planned (autoshard.config.OPTIMIZER_TRAITS says each one's).",
    )
    precision: tuple[Precision, ...] | None = Field(
        None,
        description="Pin the precision(s), e.g. bf16-mixed or bf16-mixed,32-true (default: "
        "bf16-mixed where supported, 16-mixed elsewhere, and 32-true).",
    )
    compile: bool | None = Field(
        None,
        description="torch.compile: pin it on (--compile) or off (--no-compile) (default: both "
        "planned where torch can compile here and the step-time model knows its effect).",
    )
    float8: bool | None = Field(
        None,
        description="float8 matmuls and all-gathers (torchao; FSDP2, bf16 compute, GPUs with fp8 "
        "tensor cores): pin it on (--float8) or off (--no-float8) (default: planned where it "
        "goes and the step-time model knows its effect).",
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

    @field_validator("optimizer")
    @classmethod
    def _steps_the_engine(cls, value: Optimizer, info: ValidationInfo) -> Optimizer:
        engines = OPTIMIZER_TRAITS[value].engines
        engine = info.data.get("engine")
        if engine is not None and engine not in engines:
            names = " or ".join(e.value for e in engines)
            raise ValueError(
                f"{value.value} steps the parameters of engine {names} only: give --engine "
                f"{engines[0].value} (engine= in code)"
            )
        return value

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, value: str | None) -> str | None:
        if value is not None:
            from autoshard.gpus import gpu_spec

            gpu_spec(value)  # a one-line ConfigError listing the ids
        return value


document_fields(PlanOptions)


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
    elif error["type"] == "less_than":
        message = f"give less than {ctx['lt']}"
    elif error["type"] == "less_than_equal":
        bound = ctx["le"]
        message = f"give {int(bound) if float(bound).is_integer() else bound} or less"
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
    host_memory = opts.host_memory
    if host_memory is None and plans_this_machine(opts, visible, gpu_id):
        host_memory = machine_memory()  # what CPU offload can use here
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
        host_memory=host_memory,
        bf16_supported=torch.cuda.is_bf16_supported() if visible else True,
        gpu=gpu_id,
        intra_node_bandwidth=opts.intra_node_bandwidth,
        inter_node_bandwidth=opts.inter_node_bandwidth,
    )


def plans_this_machine(options: PlanOptions, visible: int, gpu_id: str | None) -> bool:
    """Whether the plan is for this machine: its own GPUs, detected rather than given (or its
    CPU processes, ``--gpu cpu-gloo`` on one node), so that its RAM is the host memory."""
    if gpu_id == CPU_GLOO_ID:
        return options.nodes == 1
    return bool(visible) and options.gpu is None and (options.gpus or visible) <= visible


def machine_memory() -> int | None:
    """This machine's RAM, or its container's memory limit where that is lower; None where
    neither can be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total if total > 0 else None


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
        return rank_candidates(
            self.estimates, order, host_memory_checked=self.hardware.host_memory is not None
        )


def make_plan(request: PlanRequest) -> Plan:
    """Analyse the model, enumerate candidates, profile activations and estimate them all."""
    opts = request.options
    built = build_target(request.target)
    profile = analyze_model(
        built.model, target=request.label or str(request.target), built_on=built.built_on,
        extra_warnings=built.warnings,
    )  # fmt: skip
    workload, notes = resolve_workload(
        built, opts, request.label or str(request.target), profile=profile
    )
    compiles, float8s, precisions = planned_switches(opts, request.hardware)
    candidates = enumerate_candidates(
        profile,
        request.hardware,
        workload,
        engine=opts.engine,
        optimizer=opts.optimizer,
        precisions=precisions,
        micro_batch_sizes=micro_batch_sizes(built, opts),
        compiles=compiles,
        float8s=float8s,
    )
    notes.extend(unmodelled_notes(candidates))
    activations = profile_activations(
        built.model, profile, workload, batch=built.batch, precisions=precisions_of(candidates),
        attention_on=attention_device(request.hardware),
    )  # fmt: skip
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
    checked = request.hardware.host_memory is not None
    if opts.simulate:
        from autoshard.predict.simulate import refine_with_simulation, simulated_count

        simulated_count(opts.simulate, estimates)  # more than there are: one line, not minutes

        def saving(candidate: Candidate) -> int:
            return compile_saving(
                profile, candidate, request.hardware, workload, activations=activations
            )

        simulated = refine_with_simulation(
            request.target, rank_candidates(estimates, host_memory_checked=checked),
            request.hardware, workload,
            block_classes=profile.block_classes, count=opts.simulate, compile_saving=saving,
        )  # fmt: skip
        estimates = speed.attach(simulated)  # simulated peaks can change fit and headroom
    estimates = rank_candidates(estimates, host_memory_checked=checked)
    host_note = host_memory_note(estimates, request.hardware)
    if host_note:
        notes.append(host_note)
    pressure = memory_pressure_note(estimates)
    if pressure:
        notes.append(pressure)
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


def modelled_dimensions() -> frozenset[str]:
    """The planning dimensions whose effect on speed and memory the predictors model: the names
    in ``autoshard.predict.MODELLED_DIMENSIONS`` ("compile", "float8"), which the step-time and
    memory models declare when they add their terms. Until then the space proposes neither by
    itself: estimated as eager bf16 runs, they would tie with them, and the choice would be
    arbitrary."""
    from autoshard import predict

    return frozenset(getattr(predict, "MODELLED_DIMENSIONS", ()))


def compile_supported() -> str | None:
    """Why torch.compile cannot run here (this Python, this platform); None when it can.

    Asked of ``torch.compile`` in its decorator form, which checks the platform and returns
    before it imports ``torch._dynamo`` (1.2 s of CPU an estimate need not spend)."""
    try:
        torch.compile(backend="eager")
    except RuntimeError as exc:
        return f"torch {torch.__version__} cannot compile on this Python or platform ({exc})"
    return None


def planned_switches(
    options: PlanOptions, hardware: Hardware
) -> tuple[tuple[bool, ...], tuple[bool, ...], tuple[Precision, ...] | None]:
    """The torch.compile and float8 values to plan, and the precisions (float8 pinned on keeps
    the bf16 ones): a pin is taken as given, or is one line saying why it cannot be; unpinned,
    both values where the stack supports it and the model knows the effect (only off
    otherwise)."""
    modelled = modelled_dimensions()
    if options.compile is None:
        compiles = (False, True) if "compile" in modelled and not compile_supported() else (False,)
    elif options.compile and (why := compile_supported()):
        raise ConfigError(f"compile (--compile) is pinned on, but {why}: leave it unpinned")
    else:
        compiles = (options.compile,)
    precisions = options.precision
    blocker = float8_blocker(hardware, options.engine)
    if options.float8 is None:
        float8s = (False, True) if "float8" in modelled and not blocker else (False,)
    elif not options.float8:
        float8s = (False,)
    else:
        if blocker:
            raise ConfigError(f"float8 (--float8) is pinned on, but {blocker}")
        if precisions is None:
            precisions = tuple(p for p in default_precisions(hardware) if p in BF16_COMPUTE)
        others = [p.value for p in precisions if p not in BF16_COMPUTE]
        if others:
            raise ConfigError(
                f"float8 (--float8) is pinned on, but it trains with bf16 compute, not "
                f"{', '.join(others)}: give --precision bf16-mixed (or bf16-true)"
            )
        float8s = (True,)
    return compiles, float8s, precisions


def unmodelled_notes(candidates: list[Candidate]) -> list[str]:
    """One note per dimension planned that the predictors do not model yet."""
    modelled = modelled_dimensions()
    notes = []
    for name, what in (("compile", "torch.compile"), ("float8", "float8")):
        if name not in modelled and any(getattr(c, name) for c in candidates):
            notes.append(
                f"{what}: its effect on speed and memory is not modelled yet, so its candidates "
                f"are estimated as without it; trials on GPUs measure it"
            )
    return notes


def host_memory_note(estimates: list[MemoryEstimate], hardware: Hardware) -> str | None:
    """The assumption behind an offloading answer when the host memory is unknown: the
    candidate ranked first (what estimates recommend) offloads, and its need is unchecked."""
    first = estimates[0] if estimates else None
    if hardware.host_memory is not None or first is None or not first.fits:
        return None
    if not first.candidate.cpu_offload:
        return None
    return (
        f"offload needs {format_bytes(first.host_peak)} of host memory per node "
        f"({first.candidate.label()}), assumed to be there (no host memory given); give "
        "--host-memory / host_memory= for yours"
    )


def memory_pressure_note(estimates: list[MemoryEstimate]) -> str | None:
    """A warning when the first-ranked candidate fits only just: its predicted peak within a
    few percent of the usable memory, where allocator retries slow a step (its predicted speed
    already counts it: ``breakdown.pressure_s``) and an estimate a little low means OOM."""
    best = next((e for e in estimates if e.fits), None)
    if best is None or best.speed is None or best.speed.breakdown.pressure_s <= 0:
        return None
    usable = best.gpu_peak + best.headroom
    pressure = best.speed.breakdown.pressure_s
    slower = pressure / (best.speed.step_time_s - pressure)
    return (
        f"memory pressure: the first candidate ({best.candidate.label()}) peaks at "
        f"{format_bytes(best.gpu_peak)} of {format_bytes(usable)} usable "
        f"({best.headroom / usable:.1%} to spare): the allocator's retries near the limit are "
        f"predicted to cost it {slower:.0%}, and a peak a little above the estimate runs out of "
        "memory; a smaller micro-batch or more checkpointing gives it room"
    )


def fits_elsewhere(plan: Plan, *, max_nodes: int = 1024) -> tuple[int, MemoryEstimate] | None:
    """The fewest nodes (of the plan's GPUs per node) on which some candidate fits, with the
    one of most headroom there; None when none fits on ``max_nodes`` either. Doubling, then
    bisection: more nodes shard parameters, gradients and optimizer states thinner, on GPU and
    host."""
    opts = plan.request.options

    def first_fitting(nodes: int) -> MemoryEstimate | None:
        hardware = plan.hardware.model_copy(update={"nodes": nodes})
        compiles, float8s, precisions = planned_switches(opts, hardware)
        candidates = enumerate_candidates(
            plan.profile, hardware, plan.workload, engine=opts.engine, optimizer=opts.optimizer,
            precisions=precisions, micro_batch_sizes=micro_batch_sizes(plan.built, opts),
            compiles=compiles, float8s=float8s,
        )  # fmt: skip
        estimates = estimate_all(
            plan.profile, candidates, hardware, plan.workload, activations=plan.activations
        )
        # ordered as a plan on these nodes orders them (by speed there), so that a tie in
        # headroom goes to the candidate that plan would name
        estimates = rank_candidates(replace(plan.speed, hardware=hardware).attach(estimates))
        fitting = rank_candidates(estimates, RankOrder.HEADROOM)
        return fitting[0] if fitting and fitting[0].fits else None

    low = plan.hardware.nodes
    if low >= max_nodes:
        return None
    high = min(low * 2, max_nodes)  # doubling, the last step cut to max_nodes (3 is tried)
    while (found := first_fitting(high)) is None:
        if high >= max_nodes:
            return None
        low, high = high, min(high * 2, max_nodes)
    while high - low > 1:
        middle = (low + high) // 2
        there = first_fitting(middle)
        if there is None:
            low = middle
        else:
            high, found = middle, there
    return high, found


def micro_batch_sizes(built: BuiltModel, options: PlanOptions) -> tuple[int, ...]:
    """The sizes asked for, the example batch's (the loader's), or 1, 2, 4, 8; a loader whose
    batch size is fixed gives only its own."""
    if built.data is not None and built.data.fixed:
        return (built.data.samples,)
    if options.batch_size is not None:
        return options.batch_size
    if built.batch is not None:
        return (batch_samples(built.batch),)
    return DEFAULT_MICRO_BATCH_SIZES


def resolve_workload(
    built: BuiltModel,
    options: PlanOptions,
    source: str = "the target",
    *,
    profile: ModelProfile | None = None,
) -> tuple[WorkloadSpec, list[str]]:
    """The workload of one step, and a note for every number that was assumed.

    A batch that ``source`` returns is used as built (its FLOPs and activations are counted on
    it), so a ``seq_len`` that contradicts its token length is an error: counted at one length
    and reported at the other, the tokens/s and the memory would belong to different steps.
    So is a sequence past the model's context (``profile.context_length``, or found on the
    model): estimated, it would look fine; trained, it fails in every trial (an index past a
    positional table)."""
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
    limit = (
        (profile.context_length, profile.context_source)
        if profile is not None and profile.context_length
        else find_context(built.model)
    )
    context = limit[0] if limit else None
    if seq_len is not None and limit is not None and seq_len > limit[0]:
        past = f"past the model's context of {limit[0]} tokens ({limit[1]})"
        raise ConfigError(
            f"seq_len {seq_len} is {past}: give --seq-len {limit[0]} or less (seq_len= in code)"
            if options.seq_len is not None
            else f"the batch {source} returns has {seq_len} tokens per sample, {past}: build it "
            f"with {limit[0]} or fewer"
        )
    if seq_len is None and vocab is not None:
        seq_len = min(context or DEFAULT_SEQ_LEN_CAP, DEFAULT_SEQ_LEN_CAP)
        origin = f"the model's context ({context})" if context else "assumed"
        capped = " capped" if context and context > seq_len else ""
        notes.append(f"seq_len {seq_len}: {origin}{capped}; give --seq-len / seq_len= for yours")
    data = built.data
    if data is not None and data.fixed:
        asked = (
            f", not --batch-size {','.join(map(str, options.batch_size))}"
            if options.batch_size not in (None, (data.samples,))
            else ""
        )
        notes.append(
            f"micro-batch {data.samples}{asked}: {data.origin} makes its batches itself (its "
            "own batch_sampler, batch_size=None or made batches), so trials and estimates use "
            "its size; give a DataLoader with batch_size= to compare sizes"
        )
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
