"""The ``autoshard`` command: a thin typer table over the library.

Every command calls library functions and prints their result. autoshard's own errors become one
red line and exit code 1; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from autoshard.errors import AutoshardError, ConfigError
from autoshard.units import parse_size

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
    from autoshard.target.resolve import TargetSpec, parse_kwargs

    def work() -> None:
        spec = TargetSpec(spec=target, kwargs=parse_kwargs(arg or []))
        profile, _ = analyze_target(spec)
        if as_json:
            _print_json(profile.model_dump(mode="json"))
        else:
            from autoshard.ui.tables import print_profile

            print_profile(profile, console)

    _run(work, debug)


@app.command()
def estimate(
    target: TargetArg,
    arg: ArgOpt = None,
    gpus: Annotated[int, typer.Option(help="GPUs per node.")] = 8,
    nodes: Annotated[int, typer.Option(help="Nodes.")] = 1,
    gpu_memory: Annotated[str, typer.Option(help="Memory of one GPU, e.g. 80GiB.")] = "80GiB",
    host_memory: Annotated[
        str | None, typer.Option(help="Host memory per node, checked for CPU offload.")
    ] = None,
    batch_size: Annotated[
        str, typer.Option(help="Micro-batch sizes per rank, e.g. 1 or 1,2,4.")
    ] = "1",
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sample (token models).")] = None,
    engine: Annotated[str, typer.Option(help="fsdp1 or fsdp2.")] = "fsdp1",
    precision: Annotated[
        list[str] | None, typer.Option(help="Pin the precision (repeatable).")
    ] = None,
    simulate: Annotated[
        int,
        typer.Option(
            help="Also simulate the N best fitting candidates: real FSDP on fake tensors, "
            "seconds each, exact to the allocator (the table then shows the simulated peak)."
        ),
    ] = 0,
    sort: Annotated[
        str,
        typer.Option(
            help="Order of the fitting candidates: headroom (most memory left first) or speed "
            "(fastest expected first). Candidates that do not fit always come last."
        ),
    ] = "headroom",
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Predict the per-GPU and host memory of every FSDP candidate on any cluster."""
    from autoshard.analyze import analyze_target
    from autoshard.config import Engine, Hardware, Precision, WorkloadSpec
    from autoshard.predict.activations import precisions_of, profile_activations
    from autoshard.predict.analytic import estimate_all
    from autoshard.space import check_rank_order, enumerate_candidates, rank_candidates
    from autoshard.target.resolve import TargetSpec, parse_kwargs
    from autoshard.ui.tables import print_estimates

    def work() -> None:
        check_rank_order(sort, "--sort")  # before the model is built
        sizes = _parse_sizes(batch_size)
        hardware = Hardware(
            gpus_per_node=gpus,
            nodes=nodes,
            gpu_memory=parse_size(gpu_memory, flag="--gpu-memory"),
            host_memory=parse_size(host_memory, flag="--host-memory") if host_memory else None,
        )
        workload = WorkloadSpec(micro_batch_size=sizes[0], seq_len=seq_len)
        spec = TargetSpec(spec=target, kwargs=parse_kwargs(arg or []))
        profile, built = analyze_target(spec)
        candidates = enumerate_candidates(
            profile,
            hardware,
            workload,
            engine=_choice(engine, Engine, "--engine"),
            precisions=tuple(_choice(p, Precision, "--precision") for p in precision or []) or None,
            micro_batch_sizes=sizes,
        )
        acts = profile_activations(
            built.model, profile, workload, batch=built.batch, precisions=precisions_of(candidates)
        )
        ranked = rank_candidates(
            estimate_all(profile, candidates, hardware, workload, activations=acts)
        )
        if simulate < 0:
            raise ConfigError(f"--simulate {simulate}: give a number of candidates, 0 or more")
        if simulate:
            from autoshard.predict.simulate import refine_with_simulation

            ranked = refine_with_simulation(
                spec, ranked, hardware, workload,
                block_classes=profile.block_classes, count=simulate,
            )  # fmt: skip
        ranked = rank_candidates(ranked, by=sort)  # simulated peaks can change fit and headroom
        if as_json:
            _print_json(
                {
                    "profile": profile.model_dump(mode="json"),
                    "hardware": hardware.model_dump(mode="json"),
                    "workload": workload.model_dump(mode="json"),
                    "activations": acts.model_dump(mode="json"),
                    "estimates": [e.model_dump(mode="json") for e in ranked],
                }
            )
            return
        if acts.note:
            err_console.print(f"[yellow]warning:[/] {acts.note}", highlight=False)
        print_estimates(ranked, hardware, console, order=sort)

    _run(work, debug)


@app.command()
def tune(
    target: TargetArg,
    arg: ArgOpt = None,
    gpus: Annotated[
        int | None,
        typer.Option(help="GPUs per node (default: the visible GPUs; 2 CPU processes without)."),
    ] = None,
    nodes: Annotated[int, typer.Option(help="Nodes the worker group spans.")] = 1,
    node_rank: Annotated[
        int, typer.Option(help="This node's rank; node 0 drives the study, others serve it.")
    ] = 0,
    rdzv_endpoint: Annotated[
        str | None, typer.Option(help="host:port on node 0 for torchrun's rendezvous.")
    ] = None,
    gpu_memory: Annotated[
        str | None,
        typer.Option(
            help="Memory of one GPU, e.g. 80GiB (default: the visible GPU's). Without a GPU it "
            "plans for this size and caps each CPU worker's measured memory at it."
        ),
    ] = None,
    batch_size: Annotated[
        str, typer.Option(help="Micro-batch sizes to try per rank, e.g. 1 or 1,2,4.")
    ] = "1",
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sample (token models).")] = None,
    engine: Annotated[str, typer.Option(help="fsdp1 (Lightning FSDPStrategy) or fsdp2.")] = "fsdp1",
    precision: Annotated[
        list[str] | None,
        typer.Option(
            help="Pin the precision (repeatable): 32-true, bf16-mixed, 16-mixed, bf16-true."
        ),
    ] = None,
    trials: Annotated[int, typer.Option(help="Most real trials to launch.")] = 12,
    trial_timeout: Annotated[
        float, typer.Option(help="Seconds before a trial counts as hung.")
    ] = 300.0,
    warmup: Annotated[int, typer.Option(help="Untimed steps per trial.")] = 2,
    steps: Annotated[int, typer.Option(help="Timed steps per trial.")] = 3,
    storage: Annotated[
        str | None, typer.Option(help="optuna storage URL (default: SQLite in --out).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("autoshard-out"),
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run short real FSDP trials and recommend the fastest configuration that fits."""
    from autoshard.config import Engine, Hardware, Precision, WorkloadSpec
    from autoshard.search import STUDY_FILES, TuneOptions
    from autoshard.search import tune as run_study
    from autoshard.target.resolve import parse_kwargs, resolve
    from autoshard.ui.files import load_result
    from autoshard.ui.progress import StudyProgress
    from autoshard.ui.report import print_summary

    def work() -> None:
        import torch

        spec = resolve(target, parse_kwargs(arg or []))
        sizes = _parse_sizes(batch_size)
        engine_value = _choice(engine, Engine, "--engine")
        precisions = tuple(_choice(p, Precision, "--precision") for p in precision or [])
        has_gpu = torch.cuda.is_available()
        nproc = gpus or (torch.cuda.device_count() if has_gpu else 2)
        if gpu_memory is not None:
            memory = parse_size(gpu_memory, flag="--gpu-memory")
        elif has_gpu:
            memory = torch.cuda.get_device_properties(0).total_memory
        else:
            raise ConfigError(
                "no GPU here: trials run on 2 CPU processes with gloo; give --gpu-memory "
                "(e.g. --gpu-memory 80GiB) for the GPUs to plan for"
            )
        hardware = Hardware(
            gpus_per_node=nproc,
            nodes=nodes,
            gpu_memory=memory,
            bf16_supported=not has_gpu or torch.cuda.is_bf16_supported(),
        )
        workload = WorkloadSpec(micro_batch_size=sizes[0], seq_len=seq_len)
        if not has_gpu and not as_json:
            err_console.print(
                f"[dim]no GPU: trials run on {nproc} CPU processes (gloo); memory is planned "
                f"for {hardware.world_size} x {gpu_memory} GPUs[/]",
                highlight=False,
            )
        if nodes > 1 and not rdzv_endpoint:
            raise ConfigError("--nodes > 1 needs --rdzv-endpoint host:port of node 0")
        if node_rank > 0:
            from autoshard.trials.group import WorkerGroup

            console.print(
                f"node {node_rank}: serving the study driven by node 0 at {rdzv_endpoint}"
            )
            WorkerGroup(
                spec,
                log_dir=out / f"workers-node{node_rank}",
                nproc=nproc,
                nnodes=nodes,
                node_rank=node_rank,
                rdzv_endpoint=rdzv_endpoint,
            ).serve()
            return
        options = TuneOptions(
            out_dir=out,
            storage=storage,
            n_trials=trials,
            engine=engine_value,
            precisions=precisions or None,
            micro_batch_sizes=sizes,
            nproc=nproc,
            nnodes=nodes,
            rdzv_endpoint=rdzv_endpoint,
            trial_timeout=trial_timeout,
            warmup=warmup,
            steps=steps,
        )
        progress_console = err_console if as_json else console
        with StudyProgress(progress_console, total=trials) as progress:
            options.on_event = progress
            rec = run_study(spec, hardware, workload, options)
        if as_json:
            sys.stdout.write(rec.model_dump_json(indent=2) + "\n")
        else:
            print_summary(rec, console, load_result(out)[1])
            files = ", ".join(name for name in STUDY_FILES if (out / name).exists())
            console.print(f"[dim]wrote in {out}/: {files}[/]", highlight=False)

    _run(work, debug)


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--batch-size {text!r}: give positive integers, e.g. 1 or 1,2,4")
    return sizes


E = TypeVar("E", bound=Enum)


def _choice(value: str, enum: type[E], flag: str) -> E:
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(str(m.value) for m in enum)
        raise ConfigError(f"{flag} {value!r}: choose one of {allowed}") from None


@app.command()
def export(
    result: Annotated[
        Path,
        typer.Argument(
            help="Output folder or JSON of `tune` (or of `estimate --json`).", show_default=False
        ),
    ],
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="lightning, accelerate or json.")
    ] = "lightning",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")
    ] = None,
    debug: DebugOpt = False,
) -> None:
    """Write the recommendation as Lightning CLI YAML, accelerate YAML or JSON."""
    from autoshard.emit.text import render
    from autoshard.ui.files import load_result

    def work() -> None:
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
    app()


if __name__ == "__main__":
    main()
