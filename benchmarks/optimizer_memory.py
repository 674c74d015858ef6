"""Benchmark: the memory estimators against measured gloo runs, optimizer by optimizer (a row
of ``config.OPTIMIZER_TRAITS`` each), on the same configurations.

    python benchmarks/optimizer_memory.py [--write benchmarks/results/optimizer_memory_cpu.md]

Every point of a grid (two GPT shapes; FSDP1 FULL_SHARD, SHARD_GRAD_OP and NO_SHARD; fp32 and
bf16 mixed precision; foreach and for-loop; FSDP2 for the optimizers that step it) runs for real
in one group of 2 gloo processes, built and sharded as a trial does, for two steps of a plain
loop under torch's memory tracker (``benchmarks/estimate_accuracy.py``'s machinery: the peak is
the largest over the ranks); both estimates are compared with it without their GPU allowance.
A new optimizer's row is measured with the others. Target: the analytic estimate within 5% of
every measured peak.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import estimate_accuracy as accuracy  # benchmarks/, the script's own folder
from results_file import write_results


def grid() -> list[dict[str, Any]]:
    """Every row of ``OPTIMIZER_TRAITS`` on every configuration it can run."""
    from autoshard.config import OPTIMIZER_TRAITS, Optimizer

    points = []
    for optimizer, shape, engine, sharding, precision, impl in itertools.product(
        (o.value for o in Optimizer), ("gpt-tiny", "gpt-deep"), ("fsdp1", "fsdp2"),
        ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"), ("32-true", "bf16-mixed"),
        ("foreach", "for_loop"),
    ):  # fmt: skip
        row = OPTIMIZER_TRAITS[Optimizer(optimizer)]
        if engine not in (e.value for e in row.engines) or impl not in (i.value for i in row.impls):
            continue
        if impl == "for_loop" and (sharding != "FULL_SHARD" or precision != "32-true"):
            continue  # the implementation changes the step's transient only: once per shape
        points.append(dict(shape=shape, engine=engine, sharding=sharding, checkpointing="none",
                           precision=precision, micro_batch_size=1, optimizer=optimizer,
                           optimizer_impl=impl))  # fmt: skip
    return points


def estimate(points: list[dict[str, Any]]) -> list[tuple[int, int | None]]:
    """(analytic, simulated) bytes without the allowance, planned for the 2 gloo ranks the
    measurements ran on (as estimate_accuracy.py plans them); simulated None where the
    optimizer's step cannot run on fake tensors (its row's ``fake_steps``)."""
    from autoshard.analyze import analyze_target
    from autoshard.config import OPTIMIZER_TRAITS, Hardware, Precision, WorkloadSpec
    from autoshard.predict.activations import profile_activations
    from autoshard.predict.analytic import estimate_memory
    from autoshard.predict.simulate import simulate_memory

    hardware = Hardware(gpus_per_node=2, gpu_memory=80 * 1024**3, backend="gloo")
    cache: dict[str, Any] = {}
    out: list[tuple[int, int | None]] = []
    for point in points:
        target = accuracy.target_of_point(point)
        if str(target) not in cache:
            profile, built = analyze_target(target)
            workload = WorkloadSpec(seq_len=accuracy.SHAPES[point["shape"]][1])
            acts = profile_activations(built.model, profile, workload, built.batch,
                                       precisions=tuple(Precision))  # fmt: skip
            cache[str(target)] = (profile, acts)
        profile, acts = cache[str(target)]
        candidate = accuracy.candidate_of(point, profile)
        workload = accuracy.workload_of(point)
        ana = estimate_memory(profile, candidate, hardware, workload, activations=acts)
        sim = None
        if OPTIMIZER_TRAITS[candidate.optimizer].fake_steps:
            simulated = simulate_memory(target, candidate, hardware, workload,
                                        block_classes=profile.block_classes)  # fmt: skip
            sim = simulated.gpu_peak - simulated.breakdown.allowance
        out.append((ana.gpu_peak - ana.breakdown.allowance, sim))
    return out


def report(points: list[dict[str, Any]], measured: list[dict[str, Any]],
           estimates: list[tuple[int, int | None]]) -> str:  # fmt: skip
    mib = 1024**2
    lines = [
        "| optimizer | configuration | measured MiB | analytic MiB | error | simulated MiB "
        "| error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    errors: dict[tuple[str, str], list[float]] = {}
    for point, m, (ana, sim) in zip(points, measured, estimates, strict=True):
        name = f"{point['optimizer']} ({point['optimizer_impl']})"
        where = (f"{point['shape']} {point['engine']} {point['sharding']} "
                 f"{point['precision']}")  # fmt: skip
        if "error" in m:
            lines.append(f"| {name} | {where} | failed: {m['error']} | | | | |")
            continue
        real = m["tracked"]
        ea = 100 * (ana - real) / real
        errors.setdefault((point["optimizer"], "analytic"), []).append(abs(ea))
        simulated = "not simulated | "
        if sim is not None:
            es = 100 * (sim - real) / real
            errors.setdefault((point["optimizer"], "simulated"), []).append(abs(es))
            simulated = f"{sim / mib:.2f} | {es:+.1f}%"
        lines.append(f"| {name} | {where} | {real / mib:.2f} | {ana / mib:.2f} | {ea:+.1f}% | "
                     f"{simulated} |")  # fmt: skip
    lines += ["", "| optimizer | estimator | points | median abs error | max abs error | within "
              "5% |", "| --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for (optimizer, estimator), errs in errors.items():
        lines.append(
            f"| {optimizer} | {estimator} | {len(errs)} | {statistics.median(errs):.1f}% | "
            f"{max(errs):.1f}% | {sum(e <= 5.0 for e in errs)}/{len(errs)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="Write the table as markdown here.")
    parser.add_argument(
        "--only", action="append", default=[], metavar="OPTIMIZER",
        help="Only these optimizers (repeatable), e.g. adafactor.",
    )  # fmt: skip
    parser.add_argument(
        "--reuse", action="store_true", help="Reuse the saved measurements of the same points."
    )
    args = parser.parse_args()
    points = [p for p in grid() if not args.only or p["optimizer"] in args.only]
    # the measurements are kept beside the table: a rerun of the estimates does not measure again
    saved = accuracy.RESULTS / "optimizer_memory_measured_cpu.json"
    kept = json.loads(saved.read_text()) if args.reuse and saved.exists() else []
    by_point = {accuracy._key(m["point"]): m for m in kept if "error" not in m}
    missing = [p for p in points if accuracy._key(p) not in by_point]
    start = time.perf_counter()
    for m in accuracy.measure(missing, "cpu", 2) if missing else []:
        by_point[accuracy._key(m["point"])] = m
    seconds = time.perf_counter() - start
    saved.write_text(json.dumps(list(by_point.values()), indent=1) + "\n")
    measured = [by_point[accuracy._key(p)] for p in points]
    estimates = estimate(points)
    load = os.getloadavg()[0]
    only = "".join(f" --only {o}" for o in args.only)
    text = (
        "# The memory estimators against measured gloo runs, optimizer by optimizer\n\n"
        f"`python benchmarks/optimizer_memory.py{only} --write {args.write}`: {len(points)} "
        f"points, {len(missing)} measured now in {seconds:.0f} s on 2 gloo processes (load "
        f"{load:.1f}); peaks without the GPU allowance, the larger rank's.\n\n"
        + report(points, measured, estimates)
        + "\n"
    )
    print(text)
    if args.write:
        write_results(args.write, text)


if __name__ == "__main__":
    main()
