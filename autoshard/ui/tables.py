"""Rich terminal rendering of a :class:`~autoshard.results.ModelProfile` (``autoshard analyze``)."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.table import Table

from autoshard.config import Hardware
from autoshard.results import MemoryEstimate, ModelProfile
from autoshard.units import format_bytes, format_count

CLASS_ROWS = 12


def _short(path: str) -> str:
    return path.rpartition(".")[2]


def _collapse_runs(profile: ModelProfile) -> list[tuple[str, str, str]]:
    """Rows of the module tree, with runs of equal siblings (``blocks.0`` .. ``blocks.31``)
    folded into one row, so a 32-layer model reads as one line per kind of layer."""
    rows: list[tuple[str, str, str]] = []
    shown = [m for m in profile.modules if not (m.depth == 2 and m.params == 0)]
    i = 0
    while i < len(shown):
        m = shown[i]
        parent = m.name.rpartition(".")[0]
        j = i
        while (
            j + 1 < len(shown)
            and shown[j + 1].depth == m.depth
            and shown[j + 1].name.rpartition(".")[0] == parent
            and shown[j + 1].class_path == m.class_path
            and shown[j + 1].params == m.params
        ):
            j += 1
        indent = "  " * m.depth
        if j > i:
            last = shown[j].name.rpartition(".")[2]
            rows.append(
                (
                    f"{indent}{m.name} .. {last}",
                    f"{_short(m.class_path)} x{j - i + 1}",
                    f"{format_count(m.params)} each",
                )
            )
        else:
            rows.append(
                (indent + (m.name or "<root>"), _short(m.class_path), format_count(m.params))
            )
        i = j + 1
    return rows


def print_profile(profile: ModelProfile, console: Console | None = None) -> None:
    """Print what the analyzer found and proposes, for people."""
    console = console or Console()
    console.print(
        f"[bold]{profile.target}[/]  {_short(profile.model_class)}: "
        f"[bold]{format_count(profile.total_params)}[/] parameters "
        f"({profile.total_params:,}; {format_bytes(profile.param_bytes)} in {profile.param_dtype}"
        f"), built on {profile.built_on} in {profile.seconds:.2f} s",
        highlight=False,
    )

    classes = Table(title="Parameters per module class", title_justify="left")
    classes.add_column("class")
    classes.add_column("count", justify="right")
    classes.add_column("params each", justify="right")
    classes.add_column("params total", justify="right")
    classes.add_column("share", justify="right")
    blocks = set(profile.block_classes)
    names = Counter(c.name for c in profile.classes)
    for c in profile.classes[:CLASS_ROWS]:
        # Two classes of the same short name (a demo Transformer around nn.Transformer) are told
        # apart by their full path.
        name = c.class_path if names[c.name] > 1 else c.name
        name = f"[bold green]{name}[/] (block)" if c.class_path in blocks else name
        classes.add_row(
            name,
            str(c.count),
            format_count(c.params_each),
            format_count(c.params_total),
            f"{c.share:.1%}",
        )
    if len(profile.classes) > CLASS_ROWS:
        classes.caption = f"{len(profile.classes) - CLASS_ROWS} smaller classes not shown"
    console.print(classes)

    tree = Table(title="Module tree (two levels)", title_justify="left")
    tree.add_column("module")
    tree.add_column("class")
    tree.add_column("params", justify="right")
    for name, cls, params in _collapse_runs(profile):
        tree.add_row(name, cls, params)
    console.print(tree)

    proposal = Table(title="Proposed FSDP policies", title_justify="left", show_header=False)
    proposal.add_column(style="bold")
    proposal.add_column(overflow="fold")
    wrap = ", ".join(profile.wrap_policy) or (
        f"size-based, min_num_params={profile.wrap_min_params:,}"
        if profile.wrap_min_params
        else "none (one unit)"
    )
    proposal.add_row("auto_wrap_policy", f"{{{wrap}}}" if profile.wrap_policy else wrap)
    proposal.add_row("", f"[dim]{profile.wrap_reason}[/]")
    ckpt = ", ".join(profile.checkpoint_policy) or "none"
    proposal.add_row(
        "activation_checkpointing_policy", f"{{{ckpt}}}" if profile.checkpoint_policy else ckpt
    )
    proposal.add_row("", f"[dim]{profile.checkpoint_reason}[/]")
    proposal.add_row(
        "root unit",
        f"{format_count(profile.root_unit_params)} params "
        f"({profile.root_unit_params / max(profile.total_params, 1):.1%}); largest unit "
        f"{format_count(profile.largest_unit_params)}",
    )
    console.print(proposal)
    for warning in profile.warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)


def print_estimates(
    estimates: list[MemoryEstimate],
    hardware: Hardware,
    console: Console,
    *,
    order: str = "headroom",
    detail: int = 3,
) -> None:
    """Every candidate in the order given (fitting ones first, then by ``order``), then the
    breakdowns of the first ``detail`` that fit."""
    by = "most headroom first" if order == "headroom" else "fastest expected first"
    table = Table(
        title=f"Per-GPU memory on {hardware.nodes} x {hardware.gpus_per_node} GPUs of "
        f"{format_bytes(hardware.gpu_memory)} (usable {format_bytes(hardware.usable_gpu_memory)})",
        title_justify="left",
        caption=f"fitting candidates first, {by}; the rest by how far they overshoot",
        caption_justify="left",
    )
    for name, justify in (("configuration", "left"), ("fits", "left"), ("GPU peak", "right"),
                          ("headroom", "right"), ("host / node", "right")):  # fmt: skip
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for e in estimates:
        table.add_row(
            e.candidate.label(),
            "[green]yes[/]" if e.fits else "[red]no[/]",
            format_bytes(e.gpu_peak) + (" [cyan](sim)[/]" if e.method == "simulated" else ""),
            format_bytes(e.headroom),
            format_bytes(e.host_peak) if e.host_peak else "",
        )
    console.print(table)
    for e in [e for e in estimates if e.fits][:detail]:
        how = f"{e.method}, peak at {e.peak_at}" if e.peak_at else e.method
        parts = Table(title=f"Breakdown: {e.candidate.label()} ({how})", title_justify="left")
        parts.add_column("term")
        parts.add_column("bytes per GPU", justify="right")
        for term, value in e.breakdown.model_dump().items():
            parts.add_row(term.replace("_", " "), format_bytes(value))
        parts.add_row("[bold]peak[/]", f"[bold]{format_bytes(e.gpu_peak)}[/]")
        console.print(parts)
    console.print(
        "[dim]allowance = CUDA context, NCCL and allocator slack: a stated constant until a GPU "
        "measurement calibrates it[/]"
    )
