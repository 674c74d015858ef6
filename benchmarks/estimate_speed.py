"""Benchmark: how fast the estimate is, end to end, on a 70B model and on a deep encoder-decoder.

    python benchmarks/estimate_speed.py [--repeat 5] [--write benchmarks/results/estimate_speed.md]

1. Every FSDP candidate of a 70B model on 1,024 GPUs (128 nodes x 8): the whole `autoshard
   estimate` command in a fresh process, Python and torch start-up included, ``--repeat`` times
   (issue 23: at most 3 s). Then each stage in-process, to show where the time goes.
2. ``--simulate 3`` on the seed guide's 1.01B demo Transformer (nn.Transformer, 32 encoder and 32
   decoder layers), fp32 on 2 GPUs (issue 23: under 90 s in all, under 30 s per candidate).

The machine may be shared: CPU seconds (the command's own, its children's included) are the
measure, medians of the repeats; wall seconds are shown with the load average they ran under.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from results_file import write_results  # benchmarks/, the script's own folder

ROOT = Path(__file__).resolve().parents[1]
TARGET = "examples/gpt.py:build"
COMMAND = [sys.executable, "-m", "autoshard", "estimate", TARGET, "--arg", "size=70b",
           "--gpus", "8", "--nodes", "128", "--seq-len", "4096", "--batch-size", "1,2,4",
           "--json"]  # fmt: skip
# The seed guide's demo Transformer (1.01B: nn.Transformer, 32 encoder + 32 decoder layers), fp32
# on 2 GPUs, its 3 best candidates simulated (issue 23: under 90 s; over 15 minutes before).
SIMULATE = [sys.executable, "-m", "autoshard", "estimate",
            "examples/lightning_transformer.py:build", "--arg", "nlayers=32",
            "--arg", "nhid=4096", "--arg", "ninp=1024", "--arg", "nhead=64", "--gpus", "2",
            "--precision", "32-true", "--simulate", "3", "--json"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of the 70B command")
    parser.add_argument("--no-simulate", action="store_true", help="skip the demo simulation")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    runs = [_run(COMMAND) for _ in range(args.repeat)]
    cpu, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    loads = ", ".join(f"{r[2]:.1f}" for r in runs)
    lines = [
        f"70B on 1,024 GPUs, `autoshard estimate`, fresh process: **{cpu:.2f} s CPU** (median of "
        f"{len(runs)}: {', '.join(f'{r[0]:.2f}' for r in runs)}), {wall:.2f} s wall; load "
        f"average {loads} on {os.cpu_count()} cores",
        "",
        *_stages(),
    ]
    if not args.no_simulate:
        sim_cpu, sim_wall, load = _run(SIMULATE)
        lines += [
            "",
            f"1.01B encoder-decoder (64 layers), `--simulate 3`, fresh process: **{sim_cpu:.1f} s "
            f"CPU** ({sim_cpu / 3:.1f} s per candidate), {sim_wall:.1f} s wall; load average "
            f"{load:.1f} on {os.cpu_count()} cores when it started (wall seconds grow with it)",
        ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        command = " ".join(["python", "benchmarks/estimate_speed.py", *sys.argv[1:]])
        write_results(
            args.write,
            f"# Estimate speed: 70B on 1,024 GPUs; a 64-layer encoder-decoder simulated\n\n"
            f"`{command}`\n\n{time.strftime('%Y-%m-%d')}. Commands timed: "
            f"`{' '.join(COMMAND[1:])}`; `{' '.join(SIMULATE[1:])}`\n\n{text}\n",
        )


def _run(command: list[str]) -> tuple[float, float, float]:
    """CPU seconds, wall seconds and the load average at its start, of ``command`` in ROOT."""
    load, cpu, start = os.getloadavg()[0], _children_cpu(), time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return _children_cpu() - cpu, time.perf_counter() - start, load


def _stages() -> list[str]:
    """The 70B estimate's stages, in this process (CPU seconds; imports first)."""
    stages: list[tuple[str, float]] = []

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        start = time.process_time()
        out = fn()
        stages.append((name, time.process_time() - start))
        return out

    def imports() -> None:
        import autoshard.plan  # noqa: F401

    timed("import autoshard + torch", imports)
    from autoshard.analyze import analyze_model
    from autoshard.config import Hardware, WorkloadSpec
    from autoshard.predict.activations import precisions_of, profile_activations
    from autoshard.predict.analytic import estimate_all
    from autoshard.predict.calibrate import SpeedModel
    from autoshard.predict.flops import profile_flops
    from autoshard.predict.hardware import speed_for
    from autoshard.predict.speed import default_factors
    from autoshard.space import Knobs, enumerate_candidates
    from autoshard.target.resolve import TargetSpec, build_target

    target = TargetSpec(spec=f"{ROOT}/{TARGET}", kwargs={"size": "70b"})
    built = timed("build on meta", lambda: build_target(target))
    profile = timed("analyze", lambda: analyze_model(built.model, target=str(target)))
    workload = WorkloadSpec(seq_len=4096)
    hardware = Hardware(gpus_per_node=8, nodes=128, gpu_memory=80 * 1024**3)
    candidates = timed(
        "enumerate candidates",
        lambda: enumerate_candidates(
            profile, hardware, workload, Knobs(micro_batch_sizes=(1, 2, 4))
        ),
    )
    precisions = precisions_of(candidates)
    names = ", ".join(p.value for p in precisions)
    acts = timed(
        f"activation profiles (fake tensors, the first loads sympy and torch.distributed.tensor; "
        f"{names})",
        lambda: profile_activations(built.model, profile, workload, precisions=precisions),
    )
    estimates = timed(
        f"memory of {len(candidates)} candidates",
        lambda: estimate_all(profile, candidates, hardware, workload, activations=acts),
    )
    flops = timed(
        "FLOP profile (fake tensors)", lambda: profile_flops(built.model, profile, workload)
    )
    gpu, _ = speed_for(hardware)
    model = SpeedModel(profile, flops, hardware, workload, gpu, default_factors(gpu))
    estimates = timed(f"step time of {len(estimates)} candidates", lambda: model.attach(estimates))
    dynamo = "loaded" if "torch._dynamo" in sys.modules else "never loaded"
    return [
        f"{profile.total_params:,} parameters; {sum(e.fits for e in estimates)} of "
        f"{len(estimates)} candidates fit 80 GiB; torch._dynamo {dynamo}. In-process stages "
        "(CPU seconds, one run):",
        "",
        "| stage | CPU s |",
        "| --- | ---: |",
        *[f"| {name} | {sec:.2f} |" for name, sec in stages],
    ]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
