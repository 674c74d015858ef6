"""Benchmark: the step-time model against step times measured here, uncalibrated.

    python benchmarks/step_time_measured.py [--size tiny] [--seq-len 128] [--max 12]
        [--write benchmarks/results/step_time_measured_cpu.md]

Runs on what is here, as ``autoshard tune`` would: NCCL on the visible GPUs (the catalogue entry
of the detected GPU), or 2 gloo CPU processes (the ``cpu-gloo`` entry, its matmul FLOP/s and
memory bandwidth measured at run time). Each candidate of a small grid of examples/gpt.py
(sharding, checkpointing, precision, micro-batch, one unit or per-block units) is measured as a
trial (median of the timed steps) and predicted by :func:`autoshard.predict.speed.predict_speed`
with the default factors: no calibration. Prints predicted against measured per candidate, the
median and largest error, and how many pairs of candidates the prediction orders as measured
(pairs measured within 5% of each other are ties, not counted).

``benchmarks/gpu.sh speed`` runs it on a GPU machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TIE = 0.05


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", help="examples/gpt.py preset")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max", type=int, default=12, help="candidates to measure")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trial")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()

    import torch

    from autoshard.analyze import analyze_target
    from autoshard.config import Hardware, Precision, WorkloadSpec
    from autoshard.predict.flops import profile_flops
    from autoshard.predict.hardware import detected_gpu, speed_for
    from autoshard.predict.speed import predict_speed
    from autoshard.results import TrialStatus
    from autoshard.space import enumerate_candidates
    from autoshard.target.resolve import TargetSpec
    from autoshard.trials.group import WorkerGroup, default_nproc

    nproc, device = default_nproc()
    target = TargetSpec(spec=f"{ROOT}/examples/gpt.py:build", kwargs={"size": args.size})
    workload = WorkloadSpec(seq_len=args.seq_len)
    if device == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
        hardware = Hardware(gpus_per_node=nproc, gpu_memory=memory, gpu=detected_gpu())
    else:
        hardware = Hardware(gpus_per_node=nproc, gpu_memory=8 * 2**30, backend="gloo")
    gpu, note = speed_for(hardware)
    profile, built = analyze_target(target)
    flops = profile_flops(built.model, profile, workload)
    candidates = enumerate_candidates(
        profile,
        hardware,
        workload,
        precisions=(Precision.BF16_MIXED, Precision.FP32),
        micro_batch_sizes=(1, 4),
        # FSDP1's CPU offload pins host memory: it needs CUDA (design notes)
        offload=None if device == "cuda" else False,
    )
    # A spread of the grid: every k-th candidate, so each dimension varies.
    stride = max(1, len(candidates) // args.max)
    candidates = candidates[::stride][: args.max]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, WorkerGroup(target, log_dir=Path(tmp)) as group:
        for candidate in candidates:
            trial = group.run(candidate, workload, warmup=2, steps=args.steps)
            if trial.status is not TrialStatus.OK or not trial.step_time:
                print(f"{candidate.label()}: {trial.status.value} {trial.error or ''}")
                continue
            speed = predict_speed(profile, flops, candidate, hardware, workload, gpu=gpu)
            rows.append((candidate.label(), trial.step_time, speed.step_time_s))
    errors = [predicted / measured - 1 for _, measured, predicted in rows]
    right = compared = 0
    for i, (_, ma, pa) in enumerate(rows):
        for _, mb, pb in rows[i + 1 :]:
            if abs(ma / mb - 1) < TIE:
                continue
            compared += 1
            right += (ma < mb) == (pa < pb)
    lines = [
        f"examples/gpt.py size={args.size}, seq {args.seq_len}; {nproc} {device} ranks; "
        f"predicted for {gpu.id} ({gpu.name}) with the default factors"
        + (f"; {note}" if note else ""),
        "",
        "| candidate | measured step, ms | predicted, ms | error |",
        "| --- | ---: | ---: | ---: |",
        *[
            f"| {label} | {1e3 * m:.1f} | {1e3 * p:.1f} | {p / m - 1:+.0%} |"
            for label, m, p in rows
        ],
        "",
        f"median |error| {statistics.median(abs(e) for e in errors):.0%}, "
        f"max {max(abs(e) for e in errors):.0%}; pairs ordered as measured: {right}/{compared} "
        f"(pairs measured within {TIE:.0%} are ties)"
        if rows
        else "no trial ran",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        args.write.write_text(
            "# Step-time model vs measured step times (uncalibrated)\n\n"
            f"`python benchmarks/step_time_measured.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
        )


if __name__ == "__main__":
    main()
