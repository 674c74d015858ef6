"""The ``autoshard`` command: a thin table over the library.

The flags of ``estimate`` and ``tune`` are not written here: they are derived from the fields of
:class:`~autoshard.options.PlanOptions` and :class:`~autoshard.options.TuneOptions` (name, help,
default), the same objects the Python doors validate, the way litgpt derives its flags from its
functions' signatures. Every flag reaches this module as text and is validated by pydantic in
one place, so a bad value is one line naming the flag and exit code 1 (``--debug`` shows the
traceback). Warnings of the pipeline (a number it had to assume) are one line each on stderr.
"""

from __future__ import annotations

import functools
import gc
import inspect
import json
import os
import signal
import sys
import threading
import typing
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.markup import escape

from autoshard.config import RankOrder
from autoshard.emit.formats import format_help
from autoshard.errors import AutoshardError, ConfigError
from autoshard.options import PlanOptions, TuneOptions

app = typer.Typer(
    name="autoshard",
    help="Pick the PyTorch FSDP configuration for a model and a set of GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Piped or tee'd output is read by scripts and people with wide terminals: wrapping it at 80
# columns splits numbers from their units. A terminal keeps its own width.
PIPE_WIDTH = 200


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS", PIPE_WIDTH))
    return Console(stderr=stderr, width=width)


console = _console()
err_console = _console(stderr=True)

T = TypeVar("T")

TargetArg = Annotated[
    str,
    typer.Argument(
        help="Model factory: path/to/file.py:callable or package.module:callable.",
        show_default=False,
    ),
]
ArgOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--arg",
        "-a",
        help="Keyword argument for the factory, key=value (repeatable): --arg size=70b.",
    ),
]
# A switch takes no value: an empty metavar keeps typer from showing one ("--json <bool>").
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print JSON for scripts instead of tables.", metavar="")
]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.", metavar="")]


def _version(value: bool) -> None:
    if value:
        from autoshard import __version__

        sys.stdout.write(f"autoshard {__version__}\n")
        raise typer.Exit()


@app.callback()
def _group(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version.", metavar=""
        ),
    ] = False,
) -> None:
    """Pick the PyTorch FSDP configuration for a model and a set of GPUs."""


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """Show each warning once, as it happens, as one yellow line on stderr (no source line)."""
    seen: set[str] = set()

    def show(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
        # autoshard's own warnings only: a library's deprecation notice is not the user's
        # business here (--debug shows everything as Python would).
        if not category.__module__.startswith("autoshard"):
            return
        text = str(message).strip().splitlines()[0] if str(message).strip() else ""
        if text and text not in seen:
            seen.add(text)
            err_console.print(f"[yellow]warning:[/] {text}", highlight=False)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        yield


class Terminated(KeyboardInterrupt):
    """SIGTERM to the command: it ends as Ctrl-C does (a running trial is marked, the workers
    are killed, nothing recorded is lost), with one line and exit code 143."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread (the command's own, in practice)
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(fn: Callable[[], T], debug: bool) -> T:
    """Call ``fn``; turn autoshard's errors (and Ctrl-C, SIGTERM) into one line and exit code 1
    (130, 143)."""
    try:
        with _sigterm_as_interrupt():
            if debug:
                return fn()
            with _warnings_as_lines():
                return fn()
    except AutoshardError as exc:
        if debug:
            raise
        err_console.print(
            f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True
        )
        raise typer.Exit(1) from None
    except KeyboardInterrupt as exc:
        if debug:
            raise
        if isinstance(exc, Terminated):
            err_console.print("[bold red]terminated[/] (SIGTERM)")
            raise typer.Exit(143) from None
        err_console.print("[bold red]interrupted[/]")
        raise typer.Exit(130) from None


@contextmanager
def _stdout_kept_for_json(as_json: bool) -> Iterator[Any]:
    """With --json, stdout carries the JSON alone: what the model's code prints goes to stderr.
    Yields the real stdout, for the JSON."""
    real = sys.stdout
    if not as_json:
        yield real
        return
    with redirect_stdout(sys.stderr):
        yield real


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


# --------------------------------------------------------------------------------------------
# Flags derived from the option models
# --------------------------------------------------------------------------------------------

# Flags spelled otherwise than their field, for the commands' history and brevity.
FLAG_NAMES = {"out_dir": "--out", "batch_size": "--batch-size"}
# Fields that are not flags (set by code, not by people).
NOT_FLAGS = {"on_event", "on_notice", "memory_cap", "skip_dominated", "nproc"}


# What a flag takes where its field's type does not say it (all reach pydantic as text).
METAVARS = {
    "gpu_memory": "size", "host_memory": "size", "memory_cap": "size",
    "intra_node_bandwidth": "rate", "inter_node_bandwidth": "rate", "storage": "url",
    "rdzv_endpoint": "host:port", "gpu": "id",
}  # fmt: skip


def _metavar(name: str, field: Any) -> str:
    """The value a flag takes, shown in ``--help``: ``<int>``, ``<size>``, ``<engine>`` (the
    help lists the choices), ``<int,...>``; nothing for a switch."""
    annotation = field.annotation
    if annotation is bool:
        return ""
    if name in METAVARS:
        return f"<{METAVARS[name]}>"
    args = [a for a in (getattr(annotation, "__args__", None) or (annotation,)) if a is not None]
    args = [a for a in args if a is not type(None)]
    base = args[0] if args else str
    many = typing.get_origin(base) is tuple
    if many:
        base = typing.get_args(base)[0]
    if isinstance(base, type) and issubclass(base, Enum):
        text = base.__name__.lower()  # the help lists the choices
    else:
        text = {int: "int", float: "float", Path: "path"}.get(base, "text")
    return f"<{text},...>" if many else f"<{text}>"


def _flag(name: str) -> str:
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def _help(field: Any) -> str:
    text = field.description or ""
    for enum in _enums_in(field.annotation):
        text += f" Choices: {', '.join(str(m.value) for m in enum)}."
    if field.default not in (None, (), "") and "default" not in text:
        default = getattr(field.default, "value", field.default)
        text += f" (default: {default})"
    return text


def _enums_in(annotation: Any) -> list[type[Enum]]:
    args = getattr(annotation, "__args__", ()) or (annotation,)
    out: list[type[Enum]] = []
    for arg in args:
        if isinstance(arg, type) and issubclass(arg, Enum):
            out.append(arg)
        out.extend(
            a for a in getattr(arg, "__args__", ()) if isinstance(a, type) and issubclass(a, Enum)
        )
    return out


def option_parameters(
    model: type[BaseModel], skip: set[str] = NOT_FLAGS
) -> list[inspect.Parameter]:
    """One ``--flag TEXT`` per field of ``model`` (a switch for a boolean one, ``--x/--no-x`` for
    one that may be left unpinned): typer hands over text, pydantic validates."""
    out = []
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        kind: Any = bool | None if field.annotation is bool else str | None
        option = typer.Option(
            _flag(name), help=_help(field), show_default=False, metavar=_metavar(name, field)
        )
        if field.annotation == bool | None:  # a pin either way, or unpinned: --x / --no-x
            flag = _flag(name)
            kind = bool | None
            option = typer.Option(f"{flag}/--no-{flag[2:]}", help=_help(field), show_default=False)
        out.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[kind, option],
            )
        )
    return out


def with_options(*models: type[BaseModel]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Add the fields of ``models`` as flags to a command; the command receives the flags that
    were given as ``options`` (a dict: what was not given keeps the model's default)."""

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        # Resolved annotations: this module's `from __future__ import annotations` leaves them
        # as strings, which typer cannot read from a replaced signature.
        hints = typing.get_type_hints(fn, include_extras=True)
        own = inspect.signature(fn)
        own = own.replace(
            parameters=[p.replace(annotation=hints.get(p.name, p.annotation))
                        for p in own.parameters.values()]
        )  # fmt: skip
        extra = [p for m in models for p in option_parameters(m)]
        names = {p.name for p in extra}

        @functools.wraps(fn)
        def command(**kwargs: Any) -> T:
            options = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
            return fn(options={k: v for k, v in options.items() if v is not None}, **kwargs)

        params = [p for p in own.parameters.values() if p.name != "options"]
        command.__signature__ = own.replace(parameters=[*params, *extra])  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in [*params, *extra]}
        return command

    return decorate


def _target_kwargs(arg: list[str] | None) -> dict[str, Any]:
    from autoshard.target.resolve import parse_kwargs

    return parse_kwargs(arg or [])


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


@app.command()
def analyze(
    target: TargetArg,
    arg: ArgOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Count parameters per module and class, find the repeated blocks, propose FSDP policies."""

    def work() -> None:
        from autoshard.analyze import analyze_target
        from autoshard.target.adapters import to_target

        profile, _ = analyze_target(to_target(target, kwargs=_target_kwargs(arg)))
        if as_json:
            _print_json(profile.model_dump(mode="json"))
        else:
            from autoshard.ui.tables import print_profile

            print_profile(profile, console)

    _run(work, debug)


@app.command()
@with_options(PlanOptions)
def estimate(
    target: TargetArg,
    arg: ArgOpt = None,
    sort: Annotated[
        str,
        typer.Option(
            help="Order of the fitting candidates: speed (fastest predicted first; one within 5% "
            "of a faster one goes first only where that one is near the memory limit or offloads "
            "to host memory not checked) or headroom (most memory left first). Candidates that "
            "do not fit always come last."
        ),
    ] = RankOrder.SPEED.value,
    show_all: Annotated[
        bool,
        typer.Option(
            "--all",
            help="List every candidate (default: the first 20, then the decision).",
            metavar="",
        ),
    ] = False,
    timeline: Annotated[
        bool,
        typer.Option(
            "--timeline",
            help="Also list the recommended configuration's step as memory over time: each "
            "memory event's micro-batch, FSDP unit, start and duration, and live bytes.",
        ),
    ] = False,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
    *,
    options: dict[str, Any],
) -> None:
    """Predict the per-GPU and host memory of every FSDP candidate on any cluster."""

    def work() -> None:
        from autoshard.api import estimates_for
        from autoshard.options import options_from

        opts = options_from(PlanOptions, options, cli=True)
        estimates = estimates_for(
            target, opts, kwargs=_target_kwargs(arg), sort=sort, flag="--sort"
        )
        plan = estimates.plan
        assert plan is not None
        if as_json:
            rec = estimates.recommendation
            _print_json(
                {
                    "profile": plan.profile.model_dump(mode="json"),
                    "hardware": plan.hardware.model_dump(mode="json"),
                    "workload": plan.workload.model_dump(mode="json"),
                    "activations": plan.activations.model_dump(mode="json"),
                    "notes": list(plan.notes),
                    # The pipeline's decision for these inputs: what `export` writes.
                    "recommendation": rec.model_dump(mode="json") if rec else None,
                    "nothing_fits": estimates.nothing_fits,  # why no recommendation, what would
                    "estimates": [e.model_dump(mode="json") for e in estimates],
                }
            )
            return
        from autoshard.ui.tables import ROWS, print_estimates

        print_estimates(
            list(estimates), plan.hardware, console, order=RankOrder(sort),
            limit=None if show_all else ROWS, recommendation=estimates.recommendation,
            nothing_fits=estimates.nothing_fits,
        )  # fmt: skip
        if timeline:
            from autoshard.ui.timeline import print_timeline

            console.print()
            print_timeline(estimates.recommendation, console)

    _run(work, debug)


@app.command()
@with_options(PlanOptions, TuneOptions)
def tune(
    target: TargetArg,
    arg: ArgOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
    *,
    options: dict[str, Any],
) -> None:
    """Run short real FSDP trials and recommend the fastest configuration that fits."""

    def work() -> None:
        from autoshard.api import serve_study, tune_with
        from autoshard.options import options_from, split_options
        from autoshard.recommendation import load_result
        from autoshard.slurm import slurm_settings
        from autoshard.ui.files import OUTPUT_FILES
        from autoshard.ui.report import print_summary

        # Under SLURM (`srun autoshard tune ...`) the nodes, this node's rank and the rendezvous
        # come from the job's environment, unless given as flags.
        slurm = slurm_settings(os.environ)
        if slurm is not None:
            for name in ("nodes", "node_rank", "rdzv_endpoint"):
                options.setdefault(name, str(slurm[name]))
        plan_values, tune_values = split_options(options)
        opts = options_from(PlanOptions, plan_values, cli=True)
        tune_opts = options_from(TuneOptions, tune_values, cli=True)
        kwargs = _target_kwargs(arg)
        out = Path(tune_opts.out_dir)
        if tune_opts.node_rank > 0:
            console.print(
                f"node {tune_opts.node_rank}: serving the study driven by node 0 at "
                f"{tune_opts.rdzv_endpoint}"
            )
            serve_study(target, opts, tune_opts, kwargs=kwargs)
            return

        def notice(line: str) -> None:
            err_console.print(f"[yellow]note:[/] {escape(line)}", highlight=False, soft_wrap=True)

        rec = tune_with(
            target,
            opts,
            tune_opts.model_copy(update={"on_notice": notice}),
            kwargs=kwargs,
            progress=err_console if as_json else console,
            cli=True,
        )
        if as_json:
            stdout.write(rec.model_dump_json(indent=2) + "\n")
        else:
            print_summary(rec, console, load_result(out)[1])
            files = ", ".join(name for name in OUTPUT_FILES if (out / name).exists())
            console.print(f"[dim]wrote in {out}/: {files}[/]", highlight=False)

    with _stdout_kept_for_json(as_json) as stdout:
        _run(work, debug)


@app.command()
def export(
    result: Annotated[
        Path,
        typer.Argument(
            help="Output folder or JSON of `tune` (or of `estimate --json`).", show_default=False
        ),
    ],
    fmt: Annotated[
        str,
        typer.Option("--format", "-f", help=format_help()),
    ] = "lightning",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Write the recommendation in a training stack's format (--format), or as JSON."""

    def work() -> None:
        from autoshard.emit import render
        from autoshard.recommendation import load_result

        rec, _ = load_result(result)
        text = render(rec, fmt)
        if output is None:
            sys.stdout.write(text)
            return
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"-o {output}: cannot write ({exc.strerror or exc})") from None
        err_console.print(f"[dim]wrote {output}[/]", highlight=False)

    _run(work, debug)


# --- commands: add new ones above this line ---


def main() -> None:
    # Import-time objects live as long as the process: frozen, no collection walks them again,
    # nor the one at exit. An estimate makes hundreds of thousands of short-lived objects: the
    # young generation collected every 10,000 allocations, not 700. Both measured in
    # benchmarks/results/estimate_speed.md ("The CLI freezes its import-time objects").
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])
    app()


if __name__ == "__main__":
    main()
