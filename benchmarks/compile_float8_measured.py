"""Benchmark: torch.compile and float8 measured against the step-time model, on the GPUs here.

    python benchmarks/compile_float8_measured.py [--size 1b] [--seq-len 2048] [--mbs 2]
        [--write benchmarks/results/compile_float8_measured_gpu.md]

One FSDP2 configuration of examples/gpt.py (FULL_SHARD, bf16-mixed, every block checkpointed,
the block units) in its variants: eager, + torch.compile, and where the GPU has fp8 tensor cores
and torchao is installed, + float8 and + compile + float8. Each is measured as a trial (NCCL, one
process per visible GPU; the compiling steps are warm-up) and predicted by the step-time model
(:func:`autoshard.predict.speed.predict_speed`, default factors). Prints measured and predicted
step times and peaks, each variant's measured ratio to the eager run next to the published
effect sizes of benchmarks/data/published_compile_float8.json (torchtitan's Llama 3.1 8B table).
Until the step-time model has its compile and float8 terms, the predicted column is the eager
prediction for every variant, which this table then shows.

``benchmarks/gpu.sh speed`` runs it on a GPU machine; without CUDA it says so and stops.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from results_file import write_results  # benchmarks/, the script's own folder
from trial_runs import TrialLog, run_trials

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PUBLISHED = ROOT / "benchmarks" / "data" / "published_compile_float8.json"


def published_ratios() -> dict[str, float]:
    """torchtitan's published speed ratios: + compile over eager, + float8 over + compile."""
    data = json.loads(PUBLISHED.read_text())
    effect = next(e for e in data["effects"] if e["id"] == "torchtitan-h100-llama3.1-8b-g8")
    return {
        "compile": effect["compile"]["speed"]["ratio"],
        "float8": effect["float8"]["speed"]["ratio"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1b", help="examples/gpt.py preset")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--mbs", type=int, default=2, help="micro-batch size per GPU")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per trial")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compiling)")
    parser.add_argument(
        "--max-seconds", type=float, help="Most seconds of timed steps per trial (tune's budget)."
    )
    parser.add_argument(
        "--variants",
        default="eager,compile,float8,both",
        help="Which to measure, of eager, compile, float8, both (float8 only where it can run).",
    )
    parser.add_argument(
        "--fresh-group",
        action="store_true",
        help="Each variant in a fresh worker group (no earlier variant's leftovers in its peak "
        "or step time); by default one group.",
    )
    parser.add_argument("--json", type=Path, help="Each trial, rewritten after every trial.")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="Run on 2 gloo CPU processes where there is no GPU (benchmarks/gpu.sh --dry-run: "
        "the script's own path, not a measurement worth reporting).",
    )
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available() and not args.cpu:
        sys.exit("compile_float8_measured.py: no CUDA GPU here (run it with benchmarks/gpu.sh)")

    from autoshard.analyze import analyze_target
    from autoshard.config import Candidate, Checkpointing, Engine, Hardware, WorkloadSpec
    from autoshard.gpus import gpu_spec
    from autoshard.predict.flops import profile_flops
    from autoshard.predict.hardware import detected_gpu, speed_for
    from autoshard.predict.recipe import linear_shapes
    from autoshard.predict.speed import predict_speed
    from autoshard.results import TrialStatus
    from autoshard.target.resolve import TargetSpec
    from autoshard.trials.group import default_nproc

    nproc, device = default_nproc()
    target = TargetSpec(spec=f"{ROOT}/examples/gpt.py:build", kwargs={"size": args.size})
    workload = WorkloadSpec(seq_len=args.seq_len, micro_batch_size=args.mbs)
    if device == "cuda":
        memory = torch.cuda.get_device_properties(0).total_memory
        gpu_id = detected_gpu()
        hardware = Hardware(gpus_per_node=nproc, gpu_memory=memory, gpu=gpu_id)
    else:
        gpu_id = None
        hardware = Hardware(gpus_per_node=nproc, gpu_memory=8 * 2**30, backend="gloo")
    gpu, note = speed_for(hardware)
    profile, built = analyze_target(target)
    flops = profile_flops(built.model, profile, workload)
    linears = linear_shapes(built.model, profile)  # what float8 converts, for its casts
    eager = Candidate(
        engine=Engine.FSDP2,
        wrap_classes=profile.wrap_policy,
        checkpointing=Checkpointing.ALL,
        checkpoint_classes=profile.checkpoint_policy,
        micro_batch_size=args.mbs,
    )
    wanted = set(args.variants.split(","))
    switches = {"eager": {}, "compile": {"compile": True}, "float8": {"float8": True},
                "both": {"compile": True, "float8": True}}  # fmt: skip
    has_fp8 = gpu_id is not None and gpu_spec(gpu_id).fp8_flops is not None
    has_torchao = importlib.util.find_spec("torchao") is not None
    variants = [
        eager.model_copy(update=update)
        for name, update in switches.items()
        if name in wanted and (not update.get("float8") or (has_fp8 and has_torchao))
    ]
    skipped = (
        ""
        if has_fp8 and has_torchao
        else "float8 not measured: "
        + ("torchao is not installed" if has_fp8 else f"{gpu.name} has no fp8 tensor cores")
    )
    rows = []
    log = TrialLog(args.json, {"size": args.size, "seq_len": args.seq_len, "mbs": args.mbs,
                               "device": device, "gpu": gpu.id, "torch": torch.__version__,
                               "fresh_group": args.fresh_group})  # fmt: skip
    runs = run_trials(target, variants, workload, fresh=args.fresh_group, warmup=args.warmup,
                      steps=args.steps, max_seconds=args.max_seconds)  # fmt: skip
    for candidate, trial, wall in runs:
        try:  # a prediction that fails is a finding, not the end of the measurements
            speed = predict_speed(
                profile, flops, candidate, hardware, workload, gpu=gpu, linears=linears
            )
            predicted = speed.step_time_s
        except Exception as exc:
            print(f"{candidate.label()}: prediction failed: {type(exc).__name__}: {exc}")
            predicted = float("nan")
        log.add(trial, wall, predicted_step=predicted)
        if trial.status is not TrialStatus.OK or not trial.step_time:
            print(f"{candidate.label()}: {trial.status.value} {trial.error or ''}")
            continue
        peak = (trial.max_allocated or 0) / 2**30
        rows.append((candidate, trial.step_time, predicted, peak))
    base = {(c.compile, c.float8): m for c, m, _, _ in rows}
    published = published_ratios()

    def ratio(c: Candidate, measured: float) -> str:
        # against the variant without this switch: compile over eager, float8 over compile
        before = (False, False) if not c.float8 else (c.compile, False)
        if (c.compile, c.float8) == (False, False) or before not in base:
            return ""
        mine = base[before] / measured
        theirs = published["float8" if c.float8 else "compile"]
        return f"{mine:.2f}x (torchtitan {theirs:.2f}x)"

    lines = [
        f"examples/gpt.py size={args.size}, seq {args.seq_len}, micro-batch {args.mbs}; {nproc} "
        f"{device} ranks{', each variant in a fresh worker group' if args.fresh_group else ''}; "
        f"predicted for {gpu.id} ({gpu.name}) with the default factors"
        + (f"; {note}" if note else "")
        + (f"; {skipped}" if skipped else ""),
        "",
        "| candidate | measured step, ms | predicted, ms | error | peak, GiB | speed-up |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {c.label()} | {1e3 * m:.1f} | {1e3 * p:.1f} | {p / m - 1:+.0%} | {peak:.2f} | "
            f"{ratio(c, m)} |"
            for c, m, p, peak in rows
        ],
    ]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_results(
            args.write,
            "# torch.compile and float8: measured vs the step-time model\n\n"
            f"`python benchmarks/compile_float8_measured.py {' '.join(sys.argv[1:])}`\n\n{text}\n",
        )


if __name__ == "__main__":
    main()
