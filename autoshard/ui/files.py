"""The files a study leaves: ``report.json`` (:func:`autoshard.ui.report.report_data`),
``report.html`` (:mod:`autoshard.ui.html`) and each format of
:data:`autoshard.emit.formats.FORMATS` that names a file (``lightning.yaml``,
``accelerate.yaml``, ...), each written atomically
(:func:`autoshard.trials.protocol.write_text_atomically`, which the workers' messages use too).
:func:`autoshard.recommendation.load_result` reads them back (it makes the user's
:class:`~autoshard.recommendation.Recommendation`, a floor above ``ui``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from autoshard.config import Hardware
from autoshard.emit.formats import FORMATS, report_files
from autoshard.errors import AutoshardError
from autoshard.results import Decision, MemoryEstimate, Scored, TrialResult
from autoshard.trials.protocol import write_text_atomically
from autoshard.ui.charts import Page
from autoshard.ui.html import render_failed_html, render_html
from autoshard.ui.report import failure_data, outcome, report_data

# Every file a study leaves in its output folder (besides the workers' logs), named once: the
# study writes them, the command line lists them, the README's table describes them.
RECOMMENDATION_FILE = "recommendation.json"
REPORT_FILES = ("report.json", "report.html", *report_files())
JOURNAL_FILE = "trials.jsonl"  # every trial as it ended (autoshard.study.journal)
DATABASE_FILE = "study.db"  # the optuna study (autoshard.study.storage)
OUTPUT_FILES = (RECOMMENDATION_FILE, *REPORT_FILES, JOURNAL_FILE, DATABASE_FILE)


def write_report(
    rec: Decision, out_dir: Path | str, trials: Sequence[TrialResult] = ()
) -> dict[str, Path]:
    """Write :data:`REPORT_FILES` into ``out_dir``: report.json, report.html and the formats
    that name a file.

    A format that cannot express the choice (see emit) is left out; the rest is still written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    texts: dict[str, Callable[[], str]] = {
        "report.json": lambda: json.dumps(report_data(rec, trials), indent=2) + "\n",
        "report.html": lambda: render_html(rec, trials),
    }
    for row in FORMATS.values():
        if row.file_name:
            texts[row.file_name] = functools.partial(row.render, rec)
    assert tuple(texts) == REPORT_FILES
    for name, make in texts.items():
        try:
            text = make()
        except AutoshardError:
            continue
        path = out / name
        write_text_atomically(path, text)
        written[name] = path
    return written


def write_failure_report(
    out_dir: Path | str,
    *,
    target: str,
    params: int,
    hardware: Hardware,
    estimates: Sequence[MemoryEstimate],
    trials: Sequence[TrialResult],
    error: str,
) -> dict[str, Path]:
    """report.json and report.html of a study in which no configuration ran (``error``: the
    line that says why): every trial with the estimate of its candidate. No YAML: there is no
    configuration to train with."""
    from datetime import datetime, timezone

    by_label = {e.candidate.label(): e for e in estimates}
    rows = []
    for t in trials:
        s = Scored(candidate=t.candidate, estimate=by_label.get(t.candidate.label()), trial=t)
        rows.append((outcome(s) or "failed", s))
    page = Page(hardware, rows, list(trials), None)
    created = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = {
        "report.json": json.dumps(failure_data(hardware, rows, error), indent=2) + "\n",
        "report.html": render_failed_html(target, params, page, error, created),
    }
    written = {}
    for name, text in texts.items():
        write_text_atomically(out / name, text)
        written[name] = out / name
    return written
