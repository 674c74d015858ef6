"""Trials for the benchmarks that measure them (step_time_measured.py, compile_float8_measured.py):
in one worker group, as ``autoshard tune`` runs them, or each in a fresh group, so that nothing
an earlier trial left behind can bias a measurement (on the first GPU run, trials in one group
carried up to a whole model's states from the trials before them:
../shared/gpu-runs/2026-11-28-h200/README.md). Each trial's record is written as it comes, so a
run stopped by a time box keeps what it measured."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def run_trials(
    target: Any,
    candidates: Iterable[Any],
    workload: Any,
    *,
    fresh: bool,
    warmup: int = 2,
    steps: int = 5,
    max_seconds: float | None = None,
) -> Iterator[tuple[Any, Any, float]]:
    """(candidate, its TrialResult, wall seconds with the group's start) for each candidate,
    in one group or each in a fresh one. The candidate's own micro-batch is the workload's;
    ``max_seconds`` caps a trial's timed steps (by default autoshard's budget)."""
    from autoshard.options import TuneOptions
    from autoshard.trials.group import WorkerGroup

    with tempfile.TemporaryDirectory() as tmp:
        shared = None if fresh else WorkerGroup(target, log_dir=Path(tmp))
        try:
            if shared is not None:
                shared.__enter__()
            for candidate in candidates:
                started = time.perf_counter()
                group = shared or WorkerGroup(target, log_dir=Path(tmp))
                w = workload.model_copy(update={"micro_batch_size": candidate.micro_batch_size})
                try:
                    if shared is None:
                        group.__enter__()
                    budget = {} if max_seconds is None else {"max_seconds": max_seconds}
                    trial = group.run(
                        candidate, w, options=TuneOptions(warmup=warmup, steps=steps, **budget)
                    )
                finally:
                    if shared is None:
                        group.__exit__(None, None, None)
                yield candidate, trial, time.perf_counter() - started
        finally:
            if shared is not None:
                shared.__exit__(None, None, None)


class TrialLog:
    """The trials of a run and what was predicted for them, rewritten to ``path`` (JSON) after
    every trial; nothing when ``path`` is None."""

    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path, self.header, self.rows = path, header, []  # type: list[dict[str, Any]]
        self._write()

    def add(self, trial: Any, wall: float, **predicted: Any) -> dict[str, Any]:
        row = {
            "label": trial.candidate.label(),
            "wall_s": round(wall, 1),
            **predicted,
            "trial": trial.model_dump(mode="json"),
        }
        self.rows.append(row)
        self._write()
        return row

    def _write(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"header": self.header, "rows": self.rows}, indent=1))


def compare_groups(one: dict[str, Any], fresh: dict[str, Any]) -> str:
    """A markdown table: each candidate's allocated peak in one group against a fresh group's
    (a leak from earlier trials shows as a larger peak in the shared group)."""
    fresh_by = {r["label"]: r for r in fresh["rows"]}
    lines = [
        "| candidate | one group, GiB | fresh group, GiB | difference | estimated (no allowance) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in one["rows"]:
        other = fresh_by.get(row["label"])
        a, b = _peak(row), _peak(other) if other else None
        est = row.get("estimated_peak")
        diff = f"{a / b - 1:+.1%}" if a and b else ""
        lines.append(
            f"| {row['label']} | {_gib(a)} | {_gib(b)} | {diff} | "
            f"{_gib(est) if est is not None else ''} |"
        )
    return "\n".join(lines)


def _peak(row: dict[str, Any] | None) -> int | None:
    if not row or row["trial"]["status"] != "ok" or not row["trial"]["peak_allocated"]:
        return None
    return int(max(row["trial"]["peak_allocated"]))


def _gib(value: int | None) -> str:
    return "" if value is None else f"{value / 2**30:.2f}"
