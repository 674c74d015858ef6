"""Benchmark: trials one after another in one worker group, as ``autoshard tune`` runs them,
against the same trials each in a fresh group (issue 32: on an H200 each FSDP1 trial left its
flat parameters to the next; a 1B grid's peaks in one group read 28.9-52.8 GiB where each alone
read 20.6-23.8).

    python benchmarks/trial_isolation.py [--size 1b --seq-len 2048 --mbs 1,4 --max 4]
        [--write benchmarks/results/trial_isolation_gpu.md]

A spread of examples/gpt.py's grid (FSDP1 and FSDP2, the precisions, the micro-batches; the
candidates predicted to fit), on what is here: NCCL on the visible GPUs, or 2 gloo CPU processes
(tiny shapes: a dry run of the same code). It holds when, in the one group, every trial started
from the first trial's baseline (``TrialResult.baseline_bytes``), none left memory that
restarted the group (the defence, :mod:`autoshard.trials.group`, would hide a leak from the
baselines), none was contaminated, none ran out of memory that ran in its fresh group, and, on
CUDA, each allocated peak is within 1% of its fresh group's (CPU peaks are resident sets, too
noisy for 1%: not compared). Exit code 1 when it does not.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from autoshard import estimate
from autoshard.config import Candidate, WorkloadSpec
from autoshard.options import TuneOptions
from autoshard.results import TrialResult
from autoshard.sharding import cpu_workers_cannot_run
from autoshard.target.resolve import TargetSpec
from autoshard.trials.group import WorkerGroup, default_nproc
from autoshard.trials.isolation import LEFTOVER_FLOOR
from autoshard.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]

PEAK_TOLERANCE = 0.01  # CUDA: the allocator counts tensors; the same trial reads the same peak


def candidates(args: argparse.Namespace, nproc: int, device: str) -> list[Candidate]:
    """Every ``args.max``-th fitting candidate of both engines, the fastest predicted first."""
    memory: int | str = "8GiB"
    if device == "cuda":
        import torch

        memory = torch.cuda.get_device_properties(0).total_memory
    found: list[Candidate] = []
    for engine in ("fsdp1", "fsdp2"):
        ranked = estimate(
            f"{ROOT}/examples/gpt.py:build", kwargs={"size": args.size}, gpus=nproc,
            gpu_memory=memory, gpu=None if device == "cuda" else "cpu-gloo",
            seq_len=args.seq_len, batch_size=args.mbs, engine=engine, compile=False,
            float8=False,
        )  # fmt: skip
        found += [
            e.candidate
            for e in ranked
            if e.fits and (device == "cuda" or not cpu_workers_cannot_run(e.candidate))
        ]
    stride = max(1, len(found) // args.max)
    return found[::stride][: args.max]


def run_all(
    chosen: list[Candidate], args: argparse.Namespace, fresh: bool
) -> tuple[list[TrialResult], list[str]]:
    """Each trial's record, and the group's notices (a restart because a trial left memory, an
    OOM retried: in the one group, either means a trial did not leave cleanly)."""
    target = TargetSpec(spec=f"{ROOT}/examples/gpt.py:build", kwargs={"size": args.size})
    results: list[TrialResult] = []
    notices: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        group = WorkerGroup(
            target,
            TuneOptions(trial_timeout=args.trial_timeout, on_notice=notices.append),
            log_dir=Path(tmp),
        )
        try:
            for c in chosen:
                workload = WorkloadSpec(seq_len=args.seq_len, micro_batch_size=c.micro_batch_size)
                results.append(
                    group.run(
                        c, workload, options=TuneOptions(warmup=1, steps=args.steps, max_steps=8)
                    )
                )
                print(_row_text(results[-1], fresh), flush=True)
                if fresh:
                    group.close()
        finally:
            group.close()
    for line in notices:
        print(f"notice: {line}", flush=True)
    return results, notices


def _row_text(r: TrialResult, fresh: bool) -> str:
    where = "fresh group" if fresh else "one group"
    peak = format_bytes(r.max_allocated) if r.max_allocated else "-"
    base = ", ".join(format_bytes(b) for b in r.baseline_bytes)
    return f"{where:11s} {r.candidate.label():60s} {r.status.value:7s} peak {peak:>10s} from {base}"


def verdict(
    shared: list[TrialResult], fresh: list[TrialResult], device: str, notices: list[str]
) -> list[str]:
    """What is wrong, one line each (none: the trials left nothing to each other)."""
    wrong = [f"one group: {line}" for line in notices]  # the defence acted: a trial left memory
    first = shared[0].baseline_bytes if shared else ()
    for one, alone in zip(shared, fresh, strict=True):
        label = one.candidate.label()
        if one.contaminated or any(
            b - f > LEFTOVER_FLOOR for b, f in zip(one.baseline_bytes, first, strict=False)
        ):
            wrong.append(f"{label}: started from {one.baseline_bytes}, the first from {first}")
        if one.status is not alone.status:
            wrong.append(f"{label}: {one.status.value} in one group, {alone.status.value} alone")
        if device == "cuda" and one.max_allocated and alone.max_allocated:
            off = one.max_allocated / alone.max_allocated - 1
            if abs(off) > PEAK_TOLERANCE:
                wrong.append(f"{label}: peak {off:+.1%} in one group against a fresh group")
    return wrong


def table(shared: list[TrialResult], fresh: list[TrialResult], device: str) -> list[str]:
    lines = [
        "| candidate | one group | peak (one group) | baseline (one group) | fresh group | "
        "peak (fresh) | peak difference |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    for one, alone in zip(shared, fresh, strict=True):
        diff = "-"
        if one.max_allocated and alone.max_allocated:
            diff = f"{one.max_allocated / alone.max_allocated - 1:+.2%}"
        lines.append(
            f"| {one.candidate.label()} | {one.status.value} | "
            f"{format_bytes(one.max_allocated or 0)} | "
            f"{format_bytes(max(one.baseline_bytes, default=0))} | {alone.status.value} | "
            f"{format_bytes(alone.max_allocated or 0)} | {diff} |"
        )
    if device != "cuda":
        lines.append("")
        lines.append("CPU processes: peaks are resident sets (not compared); baselines are.")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="tiny", help="examples/gpt.py size (default tiny)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--mbs", default="1,2", help="micro-batch sizes, e.g. 1,4")
    p.add_argument("--max", type=int, default=6, help="candidates (a spread of the grid)")
    p.add_argument("--steps", type=int, default=3, help="timed steps at least")
    p.add_argument("--trial-timeout", type=float, default=300.0)
    p.add_argument("--write", type=Path, help="a markdown table here")
    p.add_argument("--json", type=Path, help="every trial's record here")
    args = p.parse_args()
    args.mbs = tuple(int(x) for x in args.mbs.split(","))
    nproc, device = default_nproc()
    started = time.time()
    chosen = candidates(args, nproc, device)
    shared, notices = run_all(chosen, args, fresh=False)
    fresh, _ = run_all(chosen, args, fresh=True)
    wrong = verdict(shared, fresh, device, notices)
    command = " ".join(["python", "benchmarks/trial_isolation.py", *sys.argv[1:]])
    lines = [
        f"# Trials in one worker group against a fresh group each ({device}, {nproc} ranks)",
        "",
        f"`{command}`, {time.time() - started:.0f} s.",
        "",
        *table(shared, fresh, device),
        "",
        *(f"- {w}" for w in wrong or ["every trial in one group started from the first's "
                                      "baseline and read its fresh group's status and peak"]),
    ]  # fmt: skip
    print("\n".join(lines))
    if args.write:
        args.write.write_text("\n".join(lines) + "\n")
    if args.json:
        records = [json.loads(r.model_dump_json()) for r in (*shared, *fresh)]
        args.json.write_text(json.dumps(records, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
