"""``autoshard.tune()`` from Python shows the progress ``autoshard tune`` shows: the live table in
a terminal, the same table kept up to date in one notebook output, nothing with
``progress=False``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import autoshard
import autoshard.api
import autoshard.search
from autoshard.config import ProgressEvent
from autoshard.options import TuneOptions
from autoshard.results import Scored, TrialResult, TrialStatus
from tests.test_emit import make_rec

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(kwargs={"size": "tiny"}, seq_len=64, batch_size=1, gpu_memory="2GiB", trials=2)


def _fake_study(seen: list[Any]) -> Any:
    """run_study as the search calls it: one trial starts and ends, through ``on_event``."""

    def run_study(plan: Any, options: TuneOptions) -> Any:
        seen.append(options)
        e = next(e for e in plan.estimates if e.fits)
        if options.on_event is not None:
            options.on_event(ProgressEvent.START, Scored(candidate=e.candidate, estimate=e))
            trial = TrialResult(
                candidate=e.candidate, status=TrialStatus.OK, world_size=2, step_time=0.25,
                tokens_per_s=512.0, peak_allocated=(2**20, 2**20),
            )  # fmt: skip
            options.on_event(ProgressEvent.DONE, Scored(candidate=e.candidate, trial=trial))
        return make_rec()

    return run_study


@pytest.mark.parametrize("progress", [True, False])
def test_python_tune_shows_the_cli_progress_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, progress: bool
) -> None:
    monkeypatch.chdir(ROOT)
    buffer = io.StringIO()
    terminal = Console(file=buffer, force_terminal=True, width=100)
    monkeypatch.setattr(autoshard.api, "_console", lambda: terminal)
    seen: list[Any] = []
    monkeypatch.setattr(autoshard.search, "run_study", _fake_study(seen))
    theirs: list[ProgressEvent] = []
    autoshard.tune(
        "examples/gpt.py:build", **TINY, out_dir=tmp_path, progress=progress,
        on_event=lambda kind, scored: theirs.append(kind),
    )  # fmt: skip
    assert theirs == [ProgressEvent.START, ProgressEvent.DONE]  # the caller's hook still runs
    shown = buffer.getvalue()
    if progress:
        # The command line's live table: its bar and the trial with its measured rate.
        assert "Trials" in shown and "1/2" in shown and "256 tok/s per rank" in shown
    else:
        assert shown == ""


@pytest.mark.slow
def test_python_tune_in_a_notebook_keeps_one_live_table(tmp_path: Path) -> None:
    """A real kernel runs ``autoshard.tune`` in a cell: one output, updated in place to the
    finished table (no line per trial, no output per refresh)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    source = (
        "import warnings, autoshard\n"
        'warnings.simplefilter("ignore")\n'
        'rec = autoshard.tune("examples/gpt.py:build", kwargs={"size": "tiny"}, seq_len=64, '
        'batch_size=1, gpu_memory="2GiB", trials=2, warmup=1, steps=2, '
        f"out_dir={str(tmp_path)!r})\n"
        "print(rec.chosen.candidate.label())"
    )
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(source))
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    outputs = nb.cells[0].outputs
    shown = [o for o in outputs if o.output_type == "display_data"]
    assert len(shown) == 1, [o.output_type for o in outputs]
    page = shown[0].data["text/html"]
    # The final state of the one output: both trials done, each with its status.
    assert "2/2" in page and page.count(">ok<") + page.count(">ok ") >= 1, page[:2000]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "trial:" not in printed  # the plain lines are for logs, not for a notebook
    label = printed.strip().splitlines()[-1]
    assert label.startswith("fsdp") and label.split(" mbs")[0].split()[0] in page
