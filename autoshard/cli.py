"""The ``autoshard`` command: a thin typer table over the library.

Every command calls library functions and prints their result. autoshard's own errors become one
red line and exit code 1; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from autoshard.errors import AutoshardError

app = typer.Typer(
    name="autoshard",
    help="Pick the PyTorch FSDP configuration for a model and a set of GPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

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
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks of errors.")]


@app.callback()
def _group() -> None:
    """Pick the PyTorch FSDP configuration for a model and a set of GPUs."""


def _run(fn: Callable[[], T], debug: bool) -> T:
    """Call ``fn``; turn autoshard's errors (and Ctrl-C) into one line and exit code 1."""
    try:
        return fn()
    except AutoshardError as exc:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        if debug:
            raise
        err_console.print("[bold red]interrupted[/]")
        raise typer.Exit(130) from None


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@app.command()
def analyze(
    target: TargetArg,
    arg: ArgOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Count parameters per module and class, find the repeated blocks, propose FSDP policies."""
    from autoshard.analyze import analyze_target
    from autoshard.target import TargetSpec, parse_kwargs

    def work() -> None:
        spec = TargetSpec(spec=target, kwargs=parse_kwargs(arg or []))
        profile, _ = analyze_target(spec)
        if as_json:
            _print_json(profile.model_dump(mode="json"))
        else:
            from autoshard.tables import print_profile

            print_profile(profile, console)

    _run(work, debug)


# --- commands: add new ones above this line ---


def main() -> None:
    app()


if __name__ == "__main__":
    main()
