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

``--fresh-group`` runs each trial in a worker group of its own (``benchmarks/gpu.sh all`` measures
the speed grid so, and the same grid in one group for memory: ``--compare`` sets the allocated
peaks side by side). ``benchmarks/gpu.sh`` runs it on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from trial_runs import TrialLog, compare_groups, run_trials  # benchmarks/, the script's folder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TIE = 0.05


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", help="examples/gpt.py preset")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max", type=int, default=12, help="candidates to measure")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trial")
    parser.add_argument(
        "--max-seconds", type=float, help="Most seconds of timed steps per trial (tune's budget)."
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per trial")
    parser.add_argument(
        "--fresh-group",
        action="store_true",
        help="Each trial in a fresh worker group (nothing an earlier trial left can bias it); "
        "by default all in one group, as `autoshard tune` runs them.",
    )
    parser.add_argument(
        "--json", type=Path, help="Each trial with its predictions, rewritten after every trial."
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("ONE_GROUP", "FRESH"),
        help="Compare the allocated peaks of two --json runs (one group, fresh groups) and stop.",
    )
    parser.add_argument("--write", type=Path)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.compare:
        one, fresh = (json.loads(path.read_text()) for path in args.compare)
        text = compare_groups(one, fresh)
        print(text)
        if args.write:
            args.write.write_text(
                "# Allocated peaks: trials in one worker group against each in a fresh one\n\n"
                f"`python benchmarks/step_time_measured.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
            )
        return

    import torch

    from autoshard.analyze import analyze_target
    from autoshard.config import Hardware, Precision, WorkloadSpec
    from autoshard.predict.activations import profile_activations
    from autoshard.predict.analytic import estimate_memory
    from autoshard.predict.flops import profile_flops
    from autoshard.predict.hardware import detected_gpu, speed_for
    from autoshard.predict.speed import predict_speed
    from autoshard.results import TrialStatus
    from autoshard.space import Knobs, enumerate_candidates
    from autoshard.target.resolve import TargetSpec
    from autoshard.trials.group import default_nproc

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
    precisions = (Precision.BF16_MIXED, Precision.FP32)
    acts = profile_activations(built.model, profile, workload, precisions=precisions)
    candidates = enumerate_candidates(
        profile,
        hardware,
        workload,
        Knobs(
            precisions=precisions,
            micro_batch_sizes=(1, 4),
            # FSDP1's CPU offload pins host memory: it needs CUDA (design notes)
            offload=None if device == "cuda" else False,
        ),
    )
    # A spread of the grid: every k-th candidate, so each dimension varies.
    stride = max(1, len(candidates) // args.max)
    candidates = candidates[::stride][: args.max]
    log = TrialLog(args.json, {"size": args.size, "seq_len": args.seq_len, "device": device,
                               "nproc": nproc, "gpu": gpu.id, "torch": torch.__version__,
                               "fresh_group": args.fresh_group})  # fmt: skip
    rows = []
    runs = run_trials(target, candidates, workload, fresh=args.fresh_group,
                      warmup=args.warmup, steps=args.steps,
                      max_seconds=args.max_seconds)  # fmt: skip
    for candidate, trial, wall in runs:
        w = workload.model_copy(update={"micro_batch_size": candidate.micro_batch_size})
        speed = predict_speed(profile, flops, candidate, hardware, w, gpu=gpu)
        est = estimate_memory(profile, candidate, hardware, w, activations=acts)
        log.add(trial, wall, predicted_step=speed.step_time_s,
                estimated_peak=est.gpu_peak - est.breakdown.allowance)  # fmt: skip
        if trial.status is not TrialStatus.OK or not trial.step_time:
            print(f"{candidate.label()}: {trial.status.value} {trial.error or ''}", flush=True)
            continue
        rows.append((candidate.label(), trial.step_time, speed.step_time_s))
        print(f"{candidate.label()}: {1e3 * trial.step_time:.1f} ms", flush=True)
    text = table(rows, args, nproc, device, gpu, note)
    print(text)
    if args.write:
        args.write.write_text(
            "# Step-time model vs measured step times (uncalibrated)\n\n"
            f"`python benchmarks/step_time_measured.py {' '.join(sys.argv[1:])}`\n\n{text}\n"
        )


def table(rows: list[tuple[str, float, float]], args: Any, nproc: int, device: str, gpu: Any,
          note: str) -> str:  # fmt: skip
    errors = [predicted / measured - 1 for _, measured, predicted in rows]
    right = compared = 0
    for i, (_, ma, pa) in enumerate(rows):
        for _, mb, pb in rows[i + 1 :]:
            if abs(ma / mb - 1) < TIE:
                continue
            compared += 1
            right += (ma < mb) == (pa < pb)
    groups = "each trial in a fresh worker group" if args.fresh_group else "one worker group"
    lines = [
        f"examples/gpt.py size={args.size}, seq {args.seq_len}; {nproc} {device} ranks, {groups}; "
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
    return "\n".join(lines)


if __name__ == "__main__":
    main()
