"""The files a study leaves: ``report.json`` (:func:`autoshard.ui.report.report_data`),
``report.html`` (:mod:`autoshard.ui.html`), ``lightning.yaml`` and ``accelerate.yaml``, each
written atomically (:func:`autoshard.trials.protocol.write_text_atomically`, which the
workers' messages use too).
:func:`autoshard.recommendation.load_result` reads them back (it makes the user's
:class:`~autoshard.recommendation.Recommendation`, a floor above ``ui``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.results import Decision, TrialResult
from autoshard.trials.protocol import write_text_atomically
from autoshard.ui.html import render_html
from autoshard.ui.report import report_data

# Every file a study leaves in its output folder (besides the workers' logs), named once: the
# study writes them, the command line lists them, the README's table describes them.
RECOMMENDATION_FILE = "recommendation.json"
REPORT_FILES = ("report.json", "report.html", "lightning.yaml", "accelerate.yaml")
JOURNAL_FILE = "trials.jsonl"  # every trial as it ended (autoshard.study.journal)
DATABASE_FILE = "study.db"  # the optuna study (autoshard.study.storage)
OUTPUT_FILES = (RECOMMENDATION_FILE, *REPORT_FILES, JOURNAL_FILE, DATABASE_FILE)


def write_report(
    rec: Decision, out_dir: Path | str, trials: Sequence[TrialResult] = ()
) -> dict[str, Path]:
    """Write report.json, report.html, lightning.yaml and accelerate.yaml into ``out_dir``.

    A YAML that cannot express the choice (see emit) is left out; the rest is still written.
    """
    from autoshard.emit.text import accelerate_yaml, lightning_cli_yaml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    texts = {
        "report.json": lambda: json.dumps(report_data(rec, trials), indent=2) + "\n",
        "report.html": lambda: render_html(rec, trials),
        "lightning.yaml": lambda: lightning_cli_yaml(rec),
        "accelerate.yaml": lambda: accelerate_yaml(rec),
    }
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
