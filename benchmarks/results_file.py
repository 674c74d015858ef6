"""Writing a benchmark's results file without losing what was written in it by hand."""

from __future__ import annotations

from pathlib import Path


def write_results(path: Path, generated: str, *, hand_written_from: str = "\n## Findings") -> None:
    """Write ``generated``, then the hand-written sections the file already has: everything
    from its first ``hand_written_from`` heading on, kept across reruns."""
    old = path.read_text() if path.exists() else ""
    kept = old[old.index(hand_written_from) :] if hand_written_from in old else ""
    path.write_text(generated + kept)
