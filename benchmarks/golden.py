"""The ``--write`` / ``--check`` run of a golden file (benchmarks/golden_estimates.py,
benchmarks/golden_emitted.py): collect every row, write them as JSON, or compare them with a
file written before a change and list what moved.

Rows are compared as they read back from JSON (a tuple is a list there), on both sides. A row
of the baseline that changed or is gone has moved (exit 1); a row the baseline does not have
is new (counted, not a failure): a format or grid point added later."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_golden(
    doc: str,
    collect: Callable[[], dict[str, Any]],
    *,
    what: Callable[[dict[str, Any]], str],
    show_moved: Callable[[str, Any, Any], None],
    baseline: Callable[[Any], Any] = lambda row: row,
) -> None:
    """The script's command line. ``what`` names the rows collected (e.g. "14832 rows"),
    ``show_moved`` prints one moved row (key, before, after; after is None when gone), and
    ``baseline`` maps a row as the baseline file holds it to what ``collect`` makes today
    (what varies between runs, such as an address, taken out)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--check", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    text = json.dumps(collect(), sort_keys=True, indent=0)
    got = json.loads(text)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    print(f"{what(got)} in {time.perf_counter() - start:.1f} s, {digest}")
    if args.write:
        args.write.write_text(text)
        return
    want = {key: baseline(row) for key, row in json.loads(args.check.read_text()).items()}
    moved = sorted(key for key in want if want[key] != got.get(key))
    for key in moved[:10]:
        show_moved(key, want[key], got.get(key))
    print(f"{len(moved)} of {len(want)} rows moved; {len(got.keys() - want.keys())} rows new")
    sys.exit(1 if moved else 0)
