"""Benchmark: `autoshard analyze` on a 70B-parameter GPT, end to end in a fresh process.

    python benchmarks/analyze_70b.py [--repeat 3] [--write benchmarks/results/analyze_70b.md]

Target (issue 2): under 10 s and under 2 GiB resident memory on a 2-core machine. Each run is a
new `python -m autoshard analyze ... --json` process, so the time includes Python and torch
start-up, as a user sees it; memory is the child's peak resident set (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [
    sys.executable, "-m", "autoshard", "analyze", str(ROOT / "examples/gpt.py") + ":build",
    "--arg", "size=70b", "--json",
]  # fmt: skip


def run_once() -> tuple[float, float, int]:
    """Run one analysis in a fresh process: (wall seconds, peak RSS GiB, parameters)."""
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far, so fork a fresh waiter per run.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: run the command, report its peak RSS through the pipe
        os.close(read)
        start = time.perf_counter()
        proc = subprocess.run(COMMAND, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        params = json.loads(proc.stdout)["total_params"] if proc.returncode == 0 else -1
        os.write(write, json.dumps([wall, rss_kib, params, proc.stderr[-500:]]).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.waitpid(pid, 0)
    wall, rss_kib, params, stderr = json.loads(data)
    if params < 0:
        raise SystemExit(f"analyze failed: {stderr}")
    return wall, rss_kib / 1024**2, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args()
    runs = [run_once() for _ in range(args.repeat)]
    lines = [
        f"command: {' '.join(COMMAND[1:])}",
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "",
        "| run | wall s | peak RSS GiB | parameters |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {i + 1} | {w:.2f} | {r:.2f} | {p:,} |" for i, (w, r, p) in enumerate(runs)]
    walls = [w for w, _, _ in runs]
    rss = [r for _, r, _ in runs]
    lines += [
        "",
        f"median wall {statistics.median(walls):.2f} s (target < 10 s), "
        f"max peak RSS {max(rss):.2f} GiB (target < 2 GiB)",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        args.write.write_text(
            f"# analyze 70B\n\n`python benchmarks/analyze_70b.py --repeat {args.repeat}`\n\n"
            + text
            + "\n"
        )


if __name__ == "__main__":
    main()
