"""What a study writes when it ends: recommendation.json and the reports, or, where nothing ran,
the failure's report; a full disk or a lost folder is one line, and the trials stay recorded."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

from autoshard.errors import StorageError
from autoshard.plan import Plan
from autoshard.results import Decision, MemoryEstimate, TrialResult
from autoshard.ui.files import (
    RECOMMENDATION_FILE,
    write_failure_report,
    write_report,
    write_text_atomically,
)


def write_failure(
    plan: Plan,
    out_dir: Path,
    results: Sequence[TrialResult],
    tried_with: dict[str, MemoryEstimate],
    error: str,
) -> None:
    """report.json and report.html of a study in which no configuration ran; a full disk or a
    lost folder leaves the study's own error to be said."""
    estimates = [tried_with.get(e.candidate.label(), e) for e in plan.estimates]
    with contextlib.suppress(OSError):
        write_failure_report(
            out_dir, target=plan.profile.target, params=plan.profile.total_params,
            hardware=plan.hardware, estimates=estimates, trials=results, error=error,
        )  # fmt: skip


def write_outputs(rec: Decision, out_dir: Path, results: Sequence[TrialResult]) -> None:
    """recommendation.json and the reports; a full disk or a lost folder is one line."""
    try:
        write_text_atomically(out_dir / RECOMMENDATION_FILE, rec.model_dump_json(indent=2))
        write_report(rec, out_dir, list(results))
    except OSError as exc:
        raise StorageError(
            f"{out_dir}: cannot write the recommendation and reports ({exc.strerror or exc}); "
            "the trials are recorded: free space or fix the folder, then run the same command "
            "again to write them"
        ) from None
