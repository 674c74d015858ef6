"""Rich progress of a tuning study: a live table of trials on a terminal, plain lines elsewhere,
and the final recommendation."""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from autoshard.config import Hardware, ProgressEvent
from autoshard.measure import speed_basis
from autoshard.results import Scored, TrialResult, TrialStatus
from autoshard.units import format_bytes

_STYLE = {
    TrialStatus.OK: "green",
    TrialStatus.OOM: "yellow",
    TrialStatus.ERROR: "red",
    TrialStatus.TIMEOUT: "red",
    TrialStatus.PRUNED: "dim",
    TrialStatus.SKIPPED: "dim",
}


def trial_rate(t: TrialResult) -> str:
    """The trial's measured rate, all its ranks together (the summary's table shows it per
    rank: say which)."""
    ranks = f" on {t.world_size} ranks" if t.world_size > 1 else ""
    if t.tokens_per_s:
        return f"{t.tokens_per_s:,.0f} tok/s{ranks}"
    return f"{t.samples_per_s:,.1f} samples/s{ranks}" if t.samples_per_s else ""


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
        detail if t.status is TrialStatus.OK else (t.error or "")[:70],
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
        self.bar = Progress(
            TextColumn("trials"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
        self.task = self.bar.add_task("trials", total=total)

    def __enter__(self) -> StudyProgress:
        if self.console.is_terminal:
            self.live = Live(self._render(), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.__exit__(None, None, None)

    def __call__(self, kind: ProgressEvent, scored: Scored) -> None:
        self.rows[scored.candidate.label()] = scored
        t = scored.trial
        if t is not None and t.status is TrialStatus.OK:
            self.best = max(self.best, t.tokens_per_s or t.samples_per_s or 0.0)
        if kind == ProgressEvent.DONE and t is not None and t.status.launched:
            self.bar.advance(self.task)
        if self.live is not None:
            self.live.update(self._render())
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
        table = Table(title="Trials", title_justify="left")
        for name in ("configuration", "status", "step", "measured peak", "estimate", ""):
            table.add_column(name, overflow="fold")
        star_above = self._star_above()
        for s in self.rows.values():
            if s.trial is None or s.trial.status is not TrialStatus.PRUNED:
                table.add_row(*_row(s, star_above))
        pruned = sum(
            1 for s in self.rows.values() if s.trial and s.trial.status is TrialStatus.PRUNED
        )
        if pruned:
            table.caption = f"{pruned} candidates predicted not to fit were not launched"
        return table

    def _render(self) -> Group:
        return Group(self.bar, self._table())
