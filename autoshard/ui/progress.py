"""Rich progress of a tuning study: a live table of trials on a terminal, the same table kept
up to date in a notebook cell, plain lines elsewhere."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autoshard.config import Hardware, ProgressEvent
from autoshard.measure import speed_basis
from autoshard.results import Scored, TrialResult, TrialStatus
from autoshard.ui.fit import Column, fitted_table
from autoshard.units import format_bytes

# The live table's columns; when the terminal is narrow the estimate goes first, then the step.
COLUMNS = (
    Column("configuration", keep=9, wrap=True), Column("status", keep=9),
    Column("step", "right", keep=3), Column("measured peak", "right", keep=5),
    Column("estimate", "right", keep=2), Column("result", keep=8, wrap=True),
)  # fmt: skip

_STYLE = {
    TrialStatus.OK: "green",
    TrialStatus.OOM: "yellow",
    TrialStatus.ERROR: "red",
    TrialStatus.TIMEOUT: "red",
    TrialStatus.DIVERGED: "magenta",
    TrialStatus.PRUNED: "dim",
    TrialStatus.SKIPPED: "dim",
}


def trial_rate(t: TrialResult) -> str:
    """The trial's measured rate per rank, as every view compares throughput (one GPU's, or one
    CPU worker's)."""
    ranks = max(t.world_size, 1)
    if t.tokens_per_s:
        return f"{t.tokens_per_s / ranks:,.0f} tok/s per rank"
    return f"{t.samples_per_s / ranks:,.1f} samples/s per rank" if t.samples_per_s else ""


def _first_line(text: str | None) -> str:
    """A failure's message as the table shows it: its first line, whole (wrapped, never cut)."""
    return (text or "").strip().split("\n")[0]


def _row(s: Scored, best: float | None) -> list[str]:
    """The table's cells of one trial; ``best``: the best measured rate so far, which earns a
    star, or None when the measurements do not rank (CPU trials for planned GPUs)."""
    t = s.trial
    est = format_bytes(s.estimate.gpu_peak) if s.estimate else ""
    if t is None:
        return [s.candidate.label(), "[cyan]running[/]", "", "", est, ""]
    rate = t.tokens_per_s or t.samples_per_s or 0.0
    star = best is not None and t.status is TrialStatus.OK and rate >= best
    measured = format_bytes(t.max_allocated) if t.max_allocated is not None else ""
    detail = trial_rate(t) + (" [bold]★[/]" if star else "")
    return [
        s.candidate.label(),
        f"[{_STYLE[t.status]}]{t.status.value}[/]",
        f"{t.step_time:.3f} s" if t.step_time else "",
        measured,
        est,
        detail if t.status is TrialStatus.OK else escape(_first_line(t.error)),
    ]


def _line(s: Scored, best: float | None) -> str:
    """One finished trial as a plain line (no terminal for a live table): the table's cells,
    each named, e.g. ``ok  0.068 s/step on cpu  peak 35.8 MiB (predicted 1.03 GiB)  7,557
    tok/s``."""
    label, status, step, measured, est, detail = _row(s, best)
    peak = f"peak {measured}" if measured else ""
    if est:
        peak = f"{peak} (predicted {est})" if peak else f"predicted peak {est}"
    device = f" on {s.trial.device}" if s.trial is not None and s.trial.device else ""
    cells = [label, status, f"{step}/step{device}" if step else "", peak, detail]
    return "  ".join(c for c in cells if c)


class StudyProgress:
    """Receives search events (``on_event``) and shows them."""

    def __init__(self, console: Console, total: int, hardware: Hardware | None = None) -> None:
        self.console = console
        self.hardware = hardware
        self.rows: dict[str, Scored] = {}
        self.best = 0.0
        self.live: Live | None = None
        self.cell: Any = None  # a notebook's display handle, updated in place
        self.bar = Progress(
            TextColumn("trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
        self.task = self.bar.add_task("trials", total=total)

    def __enter__(self) -> StudyProgress:
        if self.console.is_terminal:
            self.live = Live(self._render(), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        elif self.console.is_jupyter:
            self.cell = _notebook_cell(self._html())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.__exit__(None, None, None)
        self._update_cell()

    def _html(self) -> Any:
        """The bar and the table as the notebook shows them (rich's own HTML export)."""
        from IPython.display import HTML

        # Not a notebook console: that one would show every rendering as a new output.
        page = Console(
            record=True, width=self.console.width, file=io.StringIO(), force_jupyter=False
        )
        page.print(self._render())
        return HTML(page.export_html(inline_styles=True, code_format="<pre>{code}</pre>"))

    def _update_cell(self) -> None:
        if self.cell is not None:
            self.cell.update(self._html())

    def __call__(self, kind: ProgressEvent, scored: Scored) -> None:
        self.rows[scored.candidate.label()] = scored
        t = scored.trial
        if t is not None and t.status is TrialStatus.OK:
            self.best = max(self.best, t.tokens_per_s or t.samples_per_s or 0.0)
        if kind == ProgressEvent.DONE and t is not None and t.status.launched:
            self.bar.advance(self.task)
        if self.live is not None:
            self.live.update(self._render())
        elif self.cell is not None:
            self._update_cell()
        elif (
            kind in (ProgressEvent.DONE, ProgressEvent.RESUMED)
            and t is not None
            and t.status.launched
        ):
            prefix = "resumed " if kind == ProgressEvent.RESUMED else ""
            self.console.print(
                f"{prefix}trial: " + _line(scored, self._star_above()), highlight=False
            )

    def _star_above(self) -> float | None:
        """The rate a trial needs for a star: the best measured so far, unless CPU processes
        stand in for the planned GPUs, whose timings rank nothing (:func:`speed_basis`)."""
        ran = [s.trial for s in self.rows.values() if s.trial is not None]
        if self.hardware is not None and speed_basis(self.hardware, ran) == "model":
            return None
        return self.best

    def _table(self) -> Table:
        star_above = self._star_above()
        rows = [
            _row(s, star_above)
            for s in self.rows.values()
            if s.trial is None or s.trial.status is not TrialStatus.PRUNED
        ]
        pruned = sum(
            1 for s in self.rows.values() if s.trial and s.trial.status is TrialStatus.PRUNED
        )
        caption = f"{pruned} candidates predicted not to fit were not launched" if pruned else ""
        return fitted_table(
            COLUMNS, rows, self.console.width, title="Trials", title_justify="left",
            caption=caption or None, caption_justify="left",
        )  # fmt: skip

    def _render(self) -> Group:
        return Group(self.bar, self._table())


def _notebook_cell(first: Any) -> Any:
    """A display in the running notebook cell that later updates replace (IPython's
    ``display_id``: no widgets needed)."""
    from IPython.display import display

    return display(first, display_id=True)
