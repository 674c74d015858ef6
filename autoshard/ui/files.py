"""The files a study leaves and :func:`load_result`, which reads any of them back for
``autoshard export``: ``report.json`` (:func:`autoshard.ui.report.report_data`), ``report.html``
(:mod:`autoshard.ui.html`), ``lightning.yaml`` and ``accelerate.yaml``. Reading never chooses:
an ``estimate --json`` output carries the pipeline's decision (:mod:`autoshard.plan`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from autoshard.errors import AutoshardError, ResultError
from autoshard.results import Recommendation, TrialResult
from autoshard.ui.html import render_html
from autoshard.ui.report import report_data

# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def write_report(
    rec: Recommendation, out_dir: Path | str, trials: Sequence[TrialResult] = ()
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
    for name, make in texts.items():
        try:
            text = make()
        except AutoshardError:
            continue
        path = out / name
        path.write_text(text, encoding="utf-8")
        written[name] = path
    return written


def load_result(path: Path | str) -> tuple[Recommendation, list[TrialResult]]:
    """Read what ``tune`` or ``estimate`` wrote: an output folder (report.json, or
    recommendation.json + the records of its study in trials.jsonl) or one of those JSON
    files."""
    p = Path(path)
    if p.is_dir():
        for name in ("report.json", "recommendation.json"):
            if (p / name).is_file():
                return load_result(p / name)
        raise ResultError(f"{p}: no report.json or recommendation.json here; run `autoshard tune`")
    if not p.is_file():
        raise ResultError(f"{p}: no such file or folder")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultError(f"{p}: not a JSON result ({exc})") from None
    try:
        return _from_json(data, p)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ResultError(f"{p}: not an autoshard result ({where}: {first['msg']})") from None


def _from_json(data: Any, p: Path) -> tuple[Recommendation, list[TrialResult]]:
    if not isinstance(data, dict):
        raise ResultError(f"{p}: not an autoshard result (a JSON object is expected)")
    if data.get("schema", "").startswith("autoshard.report/"):
        rec = Recommendation.model_validate(data["recommendation"])
        return rec, [TrialResult.model_validate(t) for t in data.get("trials", [])]
    if "chosen" in data and "profile" in data:
        rec = Recommendation.model_validate(data)
        return rec, _read_trials(p.with_name("trials.jsonl"), rec.study)
    if "estimates" in data:
        return _from_estimates(data, p), []
    raise ResultError(f"{p}: not an autoshard result (from `tune` or `estimate --json`)")


def _read_trials(path: Path, study: str | None) -> list[TrialResult]:
    """The recommendation's own trials: one folder may hold the records of several studies
    (tuned again with other settings); a recommendation without a study name (older) reads all."""
    from autoshard.study.journal import read_records

    return read_records(path, study, error=ResultError)


def _from_estimates(data: dict[str, Any], p: Path) -> Recommendation:
    """``estimate --json``: the pipeline's decision that it carries (the same as ``recommend()``
    for the same inputs); never a choice made here."""
    if "recommendation" not in data:
        raise ResultError(
            f"{p}: this estimate JSON carries no recommendation (written by an older "
            "autoshard); run `autoshard estimate --json` again"
        )
    if data["recommendation"] is None:
        raise ResultError(f"{p}: no candidate fits in this estimate; nothing to export")
    return Recommendation.model_validate(data["recommendation"])
