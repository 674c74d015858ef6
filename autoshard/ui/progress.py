"""Rich progress of a tuning study: a live table of trials on a terminal, the same table kept
up to date in a notebook cell, plain lines elsewhere."""

from __future__ import annotations

import io
import time
from typing import Any

from rich.console import Console, ConsoleOptions, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from autoshard.config import Hardware, ProgressEvent
from autoshard.measure import speed_basis
from autoshard.results import Scored, TrialResult, TrialStatus
from autoshard.ui.fit import Column, fitted_table
from autoshard.ui.report import group_line, never_launched_groups
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
    if t.tokens_per_s_per_gpu:
        return f"{t.tokens_per_s_per_gpu:,.0f} tok/s {t.per_gpu}"
    return (
        f"{t.samples_per_s_per_gpu:,.1f} samples/s {t.per_gpu}" if t.samples_per_s_per_gpu else ""
    )


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
    """Receives search events (``on_event``) and shows them.

    In a terminal, a live view that fits it, in the order a reader needs it: the bar, the trial
    running now, the best so far, the trials that ran (newest first, as many as fit), then one
    line per reason for the candidates never launched ("32 skipped: ..."; report.html lists
    them all). At 80 x 24 the running trial and the best so far are always on screen."""

    def __init__(self, console: Console, total: int, hardware: Hardware | None = None) -> None:
        self.console = console
        self.hardware = hardware
        self.rows: dict[str, Scored] = {}
        self.best = 0.0
        self.running: Scored | None = None
        self.running_since = 0.0
        self.live: Live | None = None
        self.cell: Any = None  # a notebook's display handle, updated in place
        self.bar = Progress(
            TextColumn("trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
        self.task = self.bar.add_task("trials", total=total)

    def __enter__(self) -> StudyProgress:
        if self.console.is_terminal:
            self.live = Live(
                _Fitted(self), console=self.console, refresh_per_second=4, transient=False
            )
            self.live.__enter__()
        elif self.console.is_jupyter:
            self.cell = _notebook_cell(self._html())
        return self

    def __exit__(self, *exc: object) -> None:
        self.running = None
        if self.live is not None:
            self.live.refresh()
            self.live.__exit__(None, None, None)
        self._update_cell()

    def _html(self) -> Any:
        """The bar and the table as the notebook shows them (rich's own HTML export)."""
        from IPython.display import HTML

        # Not a notebook console: that one would show every rendering as a new output.
        page = Console(
            record=True, width=self.console.width, file=io.StringIO(), force_jupyter=False
        )
        page.print(self._render(None))
        return HTML(page.export_html(inline_styles=True, code_format="<pre>{code}</pre>"))

    def _update_cell(self) -> None:
        if self.cell is not None:
            self.cell.update(self._html())

    def __call__(self, kind: ProgressEvent, scored: Scored) -> None:
        label = scored.candidate.label()
        t = scored.trial
        if kind == ProgressEvent.START:
            self.running, self.running_since = scored, time.monotonic()
        else:
            self.rows[label] = scored
            if self.running is not None and self.running.candidate.label() == label:
                self.running = None
        if t is not None and t.status is TrialStatus.OK:
            self.best = max(self.best, t.tokens_per_s or t.samples_per_s or 0.0)
        if kind == ProgressEvent.DONE and t is not None and t.status.launched:
            self.bar.advance(self.task)
        if self.live is not None:
            self.live.refresh()
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
        if self._model_ranks():
            return None
        return self.best

    def _model_ranks(self) -> bool:
        ran = [s.trial for s in self.rows.values() if s.trial is not None]
        return self.hardware is not None and speed_basis(self.hardware, ran) == "model"

    # -- what the view shows ---------------------------------------------------------------------

    def _launched(self) -> list[Scored]:
        """The trials that ran, newest first."""
        ran = [s for s in self.rows.values() if s.trial is not None and s.trial.status.launched]
        return ran[::-1]

    def _running_line(self) -> Text:
        if self.running is None:
            done = sum(1 for _ in self._launched())
            return Text(f"running: nothing now ({done} trials ran)", style="dim")
        s = self.running
        est = f", predicted peak {format_bytes(s.estimate.gpu_peak)}" if s.estimate else ""
        since = time.monotonic() - self.running_since
        return Text.assemble(
            ("running: ", "bold cyan"), (s.candidate.label(), "cyan"), f" for {since:.0f} s{est}"
        )

    def _best_line(self) -> Text:
        ok = [s for s in self._launched() if s.trial and s.trial.status is TrialStatus.OK]
        if not ok:
            return Text("best so far: none measured yet", style="dim")
        if self._model_ranks():
            predicted = [s for s in ok if s.estimate and s.estimate.speed]
            if predicted:
                best = max(predicted, key=_predicted_per_gpu)
                return Text.assemble(
                    ("★ best so far (predicted for the planned GPUs): ", "bold green"),
                    best.candidate.label(), f", {_predicted_per_gpu(best):,.0f} {_unit(best)} "
                    "per GPU predicted",
                )  # fmt: skip
        best = max(ok, key=lambda s: _rate(s.trial))
        assert best.trial is not None
        step = f"{best.trial.step_time:.3f} s/step, " if best.trial.step_time else ""
        return Text.assemble(
            ("★ best so far: ", "bold green"), best.candidate.label(),
            f", {step}{trial_rate(best.trial)}",
        )  # fmt: skip

    def _never_launched_lines(self, width: int, most: int | None) -> list[Text]:
        """One line per reason of the candidates never launched: how many, what kept them out,
        why (:func:`never_launched_groups`, the summary's lines); cut to one line each."""
        lines = []
        for word, n, why, _ in never_launched_groups(("", s) for s in self.rows.values()):
            line = Text(group_line(word, n, why), style="dim")
            lines.append(_one_line(line, width))
        if most is not None and len(lines) > most:
            more = len(lines) - most + 1
            lines = [*lines[: most - 1], Text(f"... {more} more reasons (report.html has all)",
                                              style="dim")]  # fmt: skip
        return lines

    def _table(self, rows: list[Scored], earlier: int) -> Table:
        star_above = self._star_above()
        cells = [_row(self.running, star_above)] if self.running is not None else []
        cells += [_row(s, star_above) for s in rows]
        caption = f"... and {earlier} earlier trials (the summary lists all)" if earlier else None
        return fitted_table(
            COLUMNS, cells, self.console.width, title="Trials", title_justify="left",
            caption=caption, caption_justify="left",
        )  # fmt: skip

    def _render(self, height: int | None) -> Group:
        """Everything, or what fits ``height`` lines: the bar, the running trial and the best
        so far first, whatever the height; the trials newest first, as many as fit; one line
        per reason of those never launched, at most three then."""
        width = self.console.width
        head: list[Any] = [
            self.bar,
            *(_one_line(t, width) for t in (self._running_line(), self._best_line())),
        ]
        ran = self._launched()
        if height is None:
            tail = self._never_launched_lines(width, None)
            return Group(*head, self._table(ran, 0), *tail)
        tail = self._never_launched_lines(width, 3)
        room = height - len(head) - len(tail) - 1  # a line for the cursor rich keeps below
        shown = len(ran)
        table = self._table(ran, 0)
        while shown > 0 and _height(self.console, table) > room:
            shown -= 1
            table = self._table(ran[:shown], len(ran) - shown)
        if _height(self.console, table) > room:  # not even its header: the lines that matter
            return Group(*[*head, *tail][: max(height - 1, len(head))])
        return Group(*head, table, *tail)


class _Fitted:
    """The live view at the console's current size (a terminal may be resized mid-study)."""

    def __init__(self, progress: StudyProgress) -> None:
        self.progress = progress

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Any:
        yield self.progress._render(options.max_height or console.height)


def _one_line(text: Text, width: int) -> Text:
    """``text`` on one line of ``width``, cut with an ellipsis (a line that wraps would push
    the view past the terminal's height)."""
    text.no_wrap = True
    text.truncate(width, overflow="ellipsis")
    return text


def _height(console: Console, renderable: Any) -> int:
    return len(console.render_lines(renderable, console.options, pad=False))


def _rate(t: TrialResult | None) -> float:
    return float(t.tokens_per_s or t.samples_per_s or 0.0) if t is not None else 0.0


def _predicted_per_gpu(s: Scored) -> float:
    speed = s.estimate.speed if s.estimate else None
    if speed is None:
        return 0.0
    return float(speed.tokens_per_s_per_gpu or speed.samples_per_s)


def _unit(s: Scored) -> str:
    speed = s.estimate.speed if s.estimate else None
    return "tokens/s" if speed is not None and speed.tokens_per_s_per_gpu else "samples/s"


def _notebook_cell(first: Any) -> Any:
    """A display in the running notebook cell that later updates replace (IPython's
    ``display_id``: no widgets needed)."""
    from IPython.display import display

    return display(first, display_id=True)
