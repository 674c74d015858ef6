"""Benchmark: estimate every FSDP candidate of a 70B model on 1,024 GPUs (128 nodes x 8).

    python benchmarks/estimate_speed.py [--write benchmarks/results/estimate_speed.md]

Target (issue 3): under 10 s on a 2-core machine. Prints each stage in-process (build on meta,
analysis, the fake-tensor activation profile, enumerating and scoring every candidate, the FLOP
profile and the step-time prediction of every candidate) and the whole `autoshard estimate`
command in a fresh process, Python and torch start-up included. Then (issue 23) `--simulate 3`
on the seed guide's 1.01B demo Transformer, 64 layers in two stacks: under 90 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = f"{ROOT}/examples/gpt.py:build"
COMMAND = [sys.executable, "-m", "autoshard", "estimate", TARGET, "--arg", "size=70b",
           "--gpus", "8", "--nodes", "128", "--seq-len", "4096", "--batch-size", "1,2,4",
           "--json"]  # fmt: skip
# The seed guide's demo Transformer (1.01B: nn.Transformer, 32 encoder + 32 decoder layers), fp32
# on 2 GPUs, its 3 best candidates simulated (issue 23: under 90 s; over 15 minutes before).
SIMULATE = [sys.executable, "-m", "autoshard", "estimate",
            f"{ROOT}/examples/lightning_transformer.py:build", "--arg", "nlayers=32",
            "--arg", "nhid=4096", "--arg", "ninp=1024", "--arg", "nhead=64", "--gpus", "2",
            "--precision", "32-true", "--simulate", "3", "--json"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    start = time.perf_counter()
    from autoshard.analyze import analyze_target
    from autoshard.config import Hardware, WorkloadSpec
    from autoshard.predict.activations import precisions_of, profile_activations
    from autoshard.predict.analytic import estimate_all
    from autoshard.predict.calibrate import SpeedModel
    from autoshard.predict.flops import profile_flops
    from autoshard.predict.hardware import speed_for
    from autoshard.predict.speed import default_factors
    from autoshard.space import enumerate_candidates
    from autoshard.target.resolve import TargetSpec

    stages = [("import autoshard + torch", time.perf_counter() - start)]
    t = time.perf_counter()
    profile, built = analyze_target(TargetSpec(spec=TARGET, kwargs={"size": "70b"}))
    stages.append(("build on meta + analyze", time.perf_counter() - t))
    workload = WorkloadSpec(seq_len=4096)
    hardware = Hardware(gpus_per_node=8, nodes=128, gpu_memory=80 * 1024**3)
    # In the command's order: the candidates first, as they name the precisions to profile.
    t = time.perf_counter()
    candidates = enumerate_candidates(profile, hardware, workload, micro_batch_sizes=(1, 2, 4))
    enumerating = time.perf_counter() - t
    precisions = precisions_of(candidates)
    t = time.perf_counter()
    acts = profile_activations(built.model, profile, workload, precisions=precisions)
    names = ", ".join(p.value for p in precisions)
    stages.append((f"activation profiles (fake tensors; {names})", time.perf_counter() - t))
    t = time.perf_counter()
    estimates = estimate_all(profile, candidates, hardware, workload, activations=acts)
    scoring = time.perf_counter() - t
    stages.append((f"enumerate + score {len(candidates)} candidates", enumerating + scoring))
    t = time.perf_counter()
    flops = profile_flops(built.model, profile, workload)
    stages.append(("FLOP profile (fake tensors, one block)", time.perf_counter() - t))
    t = time.perf_counter()
    gpu, _ = speed_for(hardware)
    model = SpeedModel(profile, flops, hardware, workload, gpu, default_factors(gpu))
    estimates = model.attach(estimates)
    predicting = time.perf_counter() - t
    stages.append((f"predict the step time of {len(estimates)} candidates", predicting))
    t = time.perf_counter()
    proc = subprocess.run(COMMAND, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    stages.append(("whole `autoshard estimate` command, fresh process", time.perf_counter() - t))
    load = os.getloadavg()[0]
    t, cpu = time.perf_counter(), _children_cpu()
    proc = subprocess.run(SIMULATE, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    simulating = time.perf_counter() - t
    stages.append(("1.01B encoder-decoder (64 layers), `--simulate 3`, fresh process", simulating))
    lines = [
        f"model: {profile.total_params:,} parameters; {sum(e.fits for e in estimates)} of "
        f"{len(estimates)} candidates fit 80 GiB; {1e6 * scoring / len(estimates):.0f} us each "
        f"(memory), {1e6 * predicting / len(estimates):.0f} us each (step time)",
        "",
        "| stage | seconds |",
        "| --- | ---: |",
        *[f"| {name} | {sec:.2f} |" for name, sec in stages],
        "",
        f"`--simulate 3` on the 1.01B encoder-decoder: {_children_cpu() - cpu:.1f} s of CPU "
        f"time; the machine's load average was {load:.1f} on {os.cpu_count()} cores when it "
        "started (wall-clock seconds grow with the load)",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        args.write.write_text(
            "# estimate speed: 70B on 1,024 GPUs\n\n`python benchmarks/estimate_speed.py "
            f"--write {args.write}`\n\ncommand timed: `{' '.join(COMMAND[1:])}`\n\n{text}\n"
        )


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
