"""What the user says, validated once: :class:`PlanOptions` (what to plan for) and
:class:`TuneOptions` (how a study runs), the one split of a door's options between them, and the
one-line message a mistake becomes (it names the flag, ``--gpu-memory``, or the keyword,
``gpu_memory=``). Defaults, validation and help text live here only: the command line's flags
and ``help(autoshard.PlanOptions)`` are made from these fields."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator

from autoshard.config import (
    DEFAULT_MAX_SECONDS,
    DEFAULT_MAX_STEPS,
    DEFAULT_TARGET_SPREAD,
    DEFAULT_WORKER_LOG_CAP,
    OPTIMIZER_TRAITS,
    Engine,
    Frozen,
    InterNodeBandwidth,
    IntraNodeBandwidth,
    Loop,
    Optimizer,
    Precision,
)
from autoshard.errors import ConfigError
from autoshard.units import parse_size


def document_fields(model: type[BaseModel]) -> None:
    """Append every field of ``model``, with its type, default and description, to its
    docstring: ``help(PlanOptions)`` then says what each keyword does before pydantic's methods
    (the command line's ``--help`` takes the same descriptions)."""
    import textwrap

    def kind(annotation: object) -> str:
        if isinstance(annotation, type):
            return annotation.__name__
        text = str(annotation).replace("typing.", "").replace("collections.abc.", "")
        return text.replace("autoshard.config.", "").replace("pathlib.", "")

    lines = ["", "", "Fields (keyword arguments; flags of the command line with dashes):", ""]
    for name, field in model.model_fields.items():
        default = getattr(field.default, "value", field.default)
        shown = "" if field.is_required() else f" = {default!r}"
        lines.append(f"{name}: {kind(field.annotation)}{shown}")
        lines += textwrap.wrap(field.description or "", 88, initial_indent="    ",
                               subsequent_indent="    ")  # fmt: skip
    body = textwrap.indent("\n".join(lines), "    ")
    model.__doc__ = (model.__doc__ or "").rstrip() + body + "\n"


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

    >>> from autoshard.options import PlanOptions
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
    host_cores: int | None = Field(
        None,
        ge=1,
        description="CPU cores per node, for CPU offload's host optimizer step: each rank gets "
        "cores / ranks per node threads, as Lightning's launchers give (default: this machine's "
        "when planning for it, else torchrun's 1 thread a rank where a node has several).",
    )
    intra_node_bandwidth: IntraNodeBandwidth = None
    inter_node_bandwidth: InterNodeBandwidth = None
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


# The longest --trial-timeout (11.6 days): the workers' collective timeout is the start timeout
# plus this, in milliseconds, and must stay below 2**31 ms, the most a C int of milliseconds
# holds (poll, socket timeouts); 1e30 s was an OverflowError in every worker group.
MAX_TRIAL_TIMEOUT = 1_000_000


class TuneOptions(Frozen):
    """How to run the study: its trials, their length and where results go.

    >>> from autoshard import TuneOptions
    >>> options = TuneOptions(out_dir="runs/gpt-1b", trials=8, trial_timeout=120)
    >>> options.out_dir, options.storage is None  # the study goes to runs/gpt-1b/study.db
    (PosixPath('runs/gpt-1b'), True)
    """

    out_dir: Path = Field(Path("autoshard-out"), description="Output folder.")
    storage: str | None = Field(
        None, description="optuna storage URL (default: SQLite in the output folder)."
    )
    trials: int = Field(12, ge=1, description="Most real trials to launch.")
    trial_timeout: float = Field(
        300.0,
        gt=0,
        le=MAX_TRIAL_TIMEOUT,
        allow_inf_nan=False,
        description="Seconds before a trial counts as hung.",
    )
    warmup: int = Field(2, ge=0, description="Untimed steps per trial.")
    steps: int = Field(
        3, ge=1, description="Timed steps per trial at least; more until the spread is met."
    )
    target_spread: float = Field(
        DEFAULT_TARGET_SPREAD,
        gt=0,
        lt=1,
        allow_inf_nan=False,
        description="Time steps until the median step time is known to within this (relative, "
        "95% confidence), e.g. 0.05.",
    )
    max_steps: int = Field(DEFAULT_MAX_STEPS, ge=1, description="Most timed steps per trial.")
    max_seconds: float = Field(
        DEFAULT_MAX_SECONDS,
        gt=0,
        allow_inf_nan=False,
        description="Most seconds of timed steps per trial.",
    )
    nproc: int | None = Field(
        None,
        ge=1,
        description="Worker processes per node (default: the planned GPUs per node).",
    )
    worker_log_cap: int = Field(
        DEFAULT_WORKER_LOG_CAP,
        gt=0,
        description="Bytes of worker output kept per trial in the logs under workers/, e.g. "
        "16MiB: its first and last halves, with a line saying how much was left out "
        "(default: 16MiB).",
    )
    node_rank: int = Field(
        0, ge=0, description="This node's rank; node 0 drives the study, others serve it."
    )
    rdzv_endpoint: str | None = Field(
        None, description="host:port on node 0 for the workers' rendezvous (several nodes)."
    )
    memory_cap: int | None = Field(
        None, description="Cap on a CPU worker's measured memory (default: usable GPU memory)."
    )
    skip_dominated: bool = Field(
        True, description="Skip candidates a measured one makes pointless (False: full grid)."
    )
    wait: bool = Field(
        False, description="Another run holds the output folder: wait for it instead of refusing."
    )
    on_event: Callable[..., None] | None = Field(
        None, exclude=True, description="Called with (ProgressEvent, Scored) as trials go."
    )

    @field_validator("worker_log_cap", mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        from autoshard.units import parse_size

        return parse_size(value, flag="--worker-log-cap") if isinstance(value, str) else value

    on_notice: Callable[[str], None] | None = Field(
        None,
        exclude=True,
        description="Called with one line about the study's storage (a repaired journal, a "
        "rebuilt database, a wait for a lock); default: a StudyNotice warning.",
    )


document_fields(TuneOptions)


def split_options(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The options of a door (keyword arguments or flags) as (PlanOptions', TuneOptions')."""
    tune_fields = set(TuneOptions.model_fields)
    plan_values = {k: v for k, v in values.items() if k not in tune_fields}
    tune_values = {k: v for k, v in values.items() if k in tune_fields}
    return plan_values, tune_values


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
