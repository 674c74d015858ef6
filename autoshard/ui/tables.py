"""Rich terminal rendering of a :class:`~autoshard.results.ModelProfile` (``autoshard analyze``)."""

from __future__ import annotations

from collections import Counter

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autoshard.config import Candidate, Hardware, RankOrder
from autoshard.predict.analytic import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES
from autoshard.results import Decision, MemoryEstimate, ModelProfile, SpeedEstimate
from autoshard.space import tie_rule_words
from autoshard.ui.fit import Column, fitted_table
from autoshard.units import format_bytes, format_count, format_share

CLASS_ROWS = 12
ROWS = 20  # candidates `autoshard estimate` lists unless --all
BREAKDOWNS = 3  # the candidates that fit whose memory breakdown print_estimates shows


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
            # Instances of different sizes (Linear layers of a whole model) read as a range,
            # not as the largest one "each".
            format_count(c.params_each)
            if c.params_smallest is None
            else f"{format_count(c.params_smallest)}-{format_count(c.params_each)}",
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


def estimates_table(
    estimates: list[MemoryEstimate],
    hardware: Hardware | None,
    *,
    order: RankOrder = RankOrder.SPEED,
    limit: int | None = None,
    width: int = 200,
    chosen: Candidate | None = None,
) -> Table:
    """Every candidate in the order given (fitting ones first, then by ``order``), the first
    ``limit`` of them, no wider than ``width``; ``chosen`` (the decision's) is marked."""
    by = "most headroom first" if order is RankOrder.HEADROOM else tie_rule_words()
    title = "Per-GPU memory"
    if hardware is not None:
        title += (
            f" on {hardware.nodes} x {hardware.gpus_per_node} GPUs of "
            f"{format_bytes(hardware.gpu_memory)} (usable "
            f"{format_bytes(hardware.usable_gpu_memory)})"
        )
    shown = estimates if limit is None else estimates[:limit]
    more = (
        f"; {len(estimates) - len(shown)} more not shown (--all shows them)"
        if len(shown) < len(estimates)
        else ""
    )
    speed = any(e.speed is not None for e in shown)
    columns = [Column("configuration", keep=9, wrap=True), Column("fits", keep=9),
               Column("GPU peak", "right", keep=8), Column("headroom", "right", keep=3),
               Column("host / node", "right", keep=2)]  # fmt: skip
    if speed:
        columns += [Column("tokens/s per GPU", "right", keep=5), Column("MFU", "right", keep=1)]
    rows = []
    for e in shown:
        label = e.candidate.label()
        if chosen is not None and e.candidate == chosen:
            label = f"[bold]{label}[/]\n[green]← recommended[/]"  # a line of its own
        row = [
            label,
            "[green]yes[/]" if e.fits else "[red]no[/]",
            format_bytes(e.gpu_peak) + (" [cyan](sim)[/]" if e.method == "simulated" else ""),
            format_bytes(e.headroom),
            format_bytes(e.host_peak) if e.host_peak else "",
        ]
        if speed:
            s = e.speed
            row += [
                f"{s.tokens_per_s_per_gpu:,.0f}" if s and s.tokens_per_s_per_gpu else "",
                mfu_cell(s) if s else "",
            ]
        rows.append(row)
    capped = any(e.speed is not None and e.speed.mfu_capped for e in shown)
    cap = f"; {CAP_MARK.strip()}: {CAP_WORDS}" if capped else ""
    return fitted_table(
        columns,
        rows,
        width,
        title=title,
        title_justify="left",
        caption=f"fitting candidates first, {by}; the rest by how far they overshoot{more}{cap}",
        caption_justify="left",
    )


# A prediction held at the best published MFU of its model size and GPU generation
# (autoshard.predict.ceilings): the model predicted it faster than any published run reached.
CAP_MARK = " cap"
CAP_WORDS = (
    "held at the best published MFU for this model size and GPU generation (predicted faster "
    "than any published run)"
)


def mfu_cell(speed: SpeedEstimate) -> str:
    """A candidate's MFU as the table shows it, marked where it was capped."""
    if speed.mfu is None:
        return ""
    return format_share(speed.mfu) + (CAP_MARK if speed.mfu_capped else "")


def print_estimates(
    estimates: list[MemoryEstimate],
    hardware: Hardware,
    console: Console,
    *,
    order: RankOrder = RankOrder.SPEED,
    limit: int | None = ROWS,
    recommendation: Decision | None = None,
    nothing_fits: str | None = None,
) -> None:
    """The first ``limit`` candidates in the order given, the breakdowns of the first
    :data:`BREAKDOWNS` that fit, what the allowance is, and the decision with its reasons (what
    ``print(autoshard.recommend(...))`` and ``rec.reasons`` say)."""
    chosen = recommendation.chosen.candidate if recommendation is not None else None
    console.print(
        estimates_table(
            estimates, hardware, order=order, limit=limit, width=console.width, chosen=chosen
        )
    )
    for e in [e for e in estimates if e.fits][:BREAKDOWNS]:
        how = f"{e.method}, peak at {e.peak_at}" if e.peak_at else e.method
        rows = [[term.replace("_", " "), format_bytes(value)]
                for term, value in e.breakdown.model_dump().items()]  # fmt: skip
        rows.append(["[bold]peak[/]", f"[bold]{format_bytes(e.gpu_peak)}[/]"])
        console.print(
            fitted_table(
                [Column("term", keep=1), Column("bytes per GPU", "right", keep=1)],
                rows,
                console.width,
                title=f"Breakdown: {e.candidate.label()} ({how})",
                title_justify="left",
            )
        )
    if hardware.backend != "gloo":
        console.print(
            f"[dim]allowance = {format_bytes(CUDA_CONTEXT_BYTES)} for the CUDA context and "
            f"cuBLAS workspace + {ALLOCATOR_SLACK:.0%} of the counted bytes for NCCL and "
            "allocator slack: what no CPU estimate sees; uncalibrated until a GPU run measures "
            "it[/]",
            highlight=False,
        )
    if recommendation is None:
        # The plan's one line says what would fit (more nodes, more host memory) where it knows.
        why = escape(nothing_fits) if nothing_fits else "see the table for by how much"
        console.print(f"[bold red]Nothing fits[/]: {why}", highlight=False)
        return
    console.print()
    for line in recommendation.summary_lines():
        console.print(escape(line), highlight=False)
    console.print("[bold]Why[/]")
    for line in recommendation.reasons:
        console.print(f"  • {escape(line)}", highlight=False)
