"""Benchmark: what a tuning study costs beyond the timed steps, and how many trials the search
needs to reach the best configuration of the full grid.

    python benchmarks/tune_overhead.py [--write benchmarks/results/tune_cpu.md]

Runs on what is here: NCCL on the visible GPUs, or 2 gloo CPU processes. First the full grid
(every candidate predicted to fit, no skipping), then the search as `autoshard tune` runs it
(estimator order + dominance skipping), on examples/gpt.py. Per-trial overhead is a trial's wall
time minus its timed steps (build, sharding, warm-up, measuring, hand-off); the first trial also
pays for launching the worker group.

Last, the chosen configuration against Lightning's default ``FSDPStrategy()`` (no wrap policy:
the whole model is one FSDP unit; FULL_SHARD; no checkpointing) at the Trainer's default
precision and at the chosen one, same model and batch, alternating runs in one worker group. On
a GPU machine this is the throughput comparison of issue 4 (NCCL, one process per GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import autoshard
from autoshard.config import Candidate, Precision, WorkloadSpec
from autoshard.options import TuneOptions
from autoshard.results import TrialStatus
from autoshard.study.journal import read_records
from autoshard.target.resolve import TargetSpec
from autoshard.trials.group import WorkerGroup, default_nproc

ROOT = Path(__file__).resolve().parents[1]


def run(skip_dominated: bool, n_trials: int, out: Path, target: TargetSpec, seq: int):
    nproc, device = default_nproc()
    memory = 4 * 1024**3
    if device == "cuda":
        import torch

        memory = torch.cuda.get_device_properties(0).total_memory
    start = time.perf_counter()
    rec = autoshard.tune(
        target,
        # On CPU the trials plan for the CPU processes themselves: their timings decide.
        gpus=nproc, gpu_memory=memory, gpu=None if device == "cuda" else "cpu-gloo",
        seq_len=seq, precision=(Precision.FP32, Precision.BF16_MIXED), batch_size=(1, 2),
        out_dir=out, trials=n_trials, skip_dominated=skip_dominated,
        memory_cap=None if device == "cuda" else 8 * 1024**3,
    )  # fmt: skip
    wall = time.perf_counter() - start

    trials = read_records(out / "trials.jsonl")
    launched = [t for t in trials if t.status.launched]  # not pruned, not skipped
    return rec, launched, wall


def against_lightning_default(
    chosen: Candidate, target: TargetSpec, seq: int, log_dir: Path, rounds: int = 3
) -> list[tuple[str, float]]:
    """Median tokens/s of the chosen candidate and of Lightning's default FSDPStrategy()."""
    default = Candidate(micro_batch_size=chosen.micro_batch_size, precision=Precision.FP32)
    same_precision = default.model_copy(update={"precision": chosen.precision})
    runs: dict[str, tuple[Candidate, list[float]]] = {
        "chosen: " + chosen.label(): (chosen, []),
        "Lightning FSDPStrategy() (32-true)": (default, []),
        f"Lightning FSDPStrategy() ({chosen.precision.value})": (same_precision, []),
    }
    workload = WorkloadSpec(seq_len=seq)
    with WorkerGroup(target, TuneOptions(nproc=default_nproc()[0]), log_dir=log_dir) as group:
        for _ in range(rounds):  # alternate, so that drift hits every configuration alike
            for candidate, rates in runs.values():
                result = group.run(candidate, workload, options=TuneOptions(warmup=2, steps=5))
                if result.status is TrialStatus.OK and result.tokens_per_s:
                    rates.append(result.tokens_per_s)
    return [(name, statistics.median(rates) if rates else 0.0) for name, (_, rates) in runs.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    target = TargetSpec(spec=f"{ROOT}/examples/gpt.py:build", kwargs={"size": args.size})
    with tempfile.TemporaryDirectory() as tmp:
        grid_rec, grid, grid_wall = run(False, 1000, Path(tmp) / "grid", target, args.seq_len)
        search_rec, search, search_wall = run(True, 12, Path(tmp) / "search", target, args.seq_len)
        versus = against_lightning_default(
            search_rec.chosen.candidate, target, args.seq_len, Path(tmp) / "versus"
        )
    best = grid_rec.chosen.candidate.label()
    order = [t.candidate.label() for t in search]
    found_at = order.index(best) + 1 if best in order else None
    ok = [t for t in grid if t.status is TrialStatus.OK and t.step_time]
    overhead = [t.duration - sum(t.step_times) for t in ok[1:]]  # the first also launches
    speed = {t.candidate.label(): t.tokens_per_s or 0 for t in ok}
    chosen = search_rec.chosen.candidate.label()
    lines = [
        f"model: examples/gpt.py size={args.size}, seq {args.seq_len}; "
        f"{grid[0].world_size} {grid[0].device} ranks",
        "",
        "| | full grid | search |",
        "| --- | ---: | ---: |",
        f"| trials launched | {len(grid)} | {len(search)} |",
        f"| wall time, s | {grid_wall:.1f} | {search_wall:.1f} |",
        f"| chosen | {best} | {chosen} |",
        f"| chosen tokens/s (grid measurement) | {speed.get(best, 0):,.0f} | "
        f"{speed.get(chosen, 0):,.0f} |",
        "",
        f"search reached the grid's best at trial {found_at} of {len(search)}"
        if found_at
        else "search did not try the grid's best (see tokens/s above for the gap)",
        f"per-trial overhead (wall - timed steps): median {statistics.median(overhead):.2f} s, "
        f"max {max(overhead):.2f} s; first trial incl. group launch "
        f"{grid[0].duration + grid[0].launch_seconds:.1f} s",
    ]
    base = versus[1][1] or 1.0
    lines += [
        "",
        "| chosen vs Lightning's default (median of 3 alternating runs) | tokens/s | vs default |",
        "| --- | ---: | ---: |",
        *[f"| {name} | {rate:,.0f} | {rate / base:.2f}x |" for name, rate in versus],
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        args.write.write_text(
            f"# tune: overhead, trials to best, against Lightning's default\n\n`python "
            f"benchmarks/tune_overhead.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
        )


if __name__ == "__main__":
    main()
