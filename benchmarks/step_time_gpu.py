"""The GPU rows of the step-time benchmark: step times autoshard measured on a GPU
(``benchmarks/data/measured_gpu.json``, each run cited to its files), predicted as the planner
predicts them, split by configuration into a fitting and a held-out set before the model was
changed for them (:func:`split`).

Imported by ``benchmarks/step_time_published.py``, which reports these two sets beside the
published ones; run alone it prints only them:

    python benchmarks/step_time_gpu.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "measured_gpu.json"


def configuration(run: dict[str, Any], row: dict[str, Any]) -> str:
    """What a row measured, independent of the run it came from: the model, the sequence and
    the candidate. Two runs of one configuration are one configuration (in one set)."""
    return f"{run['model']['size']} s{run['seq_len']} {row['label']}"


def stratum(run: dict[str, Any], row: dict[str, Any]) -> tuple[str, str, bool, bool]:
    """The class a configuration is split within: model, precision, float8, CPU offload (so
    each class with two or more configurations has rows in both sets)."""
    c = row["candidate"]
    return run["model"]["size"], c["precision"], bool(c["float8"]), bool(c["cpu_offload"])


def split(data: dict[str, Any]) -> dict[str, str]:
    """'fitting' or 'held-out' for every configuration, fixed by the configurations alone
    (never by an error): within each :func:`stratum`, the configurations in the order of
    sha256 of their :func:`configuration` text, alternately fitting and held-out, the first
    fitting. Fixed before any change to the model that these rows were added for."""
    classes: dict[tuple[str, str, bool, bool], set[str]] = {}
    for run in data["runs"]:
        for row in run["rows"]:
            classes.setdefault(stratum(run, row), set()).add(configuration(run, row))
    sets = {}
    for members in classes.values():
        ordered = sorted(members, key=lambda text: hashlib.sha256(text.encode()).hexdigest())
        for i, text in enumerate(ordered):
            sets[text] = "fitting" if i % 2 == 0 else "held-out"
    return sets


def _profiles(size: str, seq_len: int, cache: dict[Any, Any]) -> tuple[Any, ...]:
    """(profile, FLOP profile, activations, float8's linear shapes, the meta model) of
    examples/gpt.py's preset ``size`` at ``seq_len``, once per shape."""
    key = ("examples/gpt.py", size, seq_len)
    if key not in cache:
        import torch

        from autoshard.analyze import analyze_model
        from autoshard.config import WorkloadSpec
        from autoshard.predict.activations import profile_activations
        from autoshard.predict.flops import profile_flops
        from autoshard.predict.recipe import linear_shapes
        from examples.gpt import build

        with torch.device("meta"):
            model = build(size=size)
        profile = analyze_model(model)
        at_len = WorkloadSpec(seq_len=seq_len)
        flops = profile_flops(model, profile, at_len)
        acts = profile_activations(model, profile, at_len, precisions=("bf16-mixed", "32-true"))
        cache[key] = profile, flops, acts, linear_shapes(model, profile)
    return tuple(cache[key])


def predict(run: dict[str, Any], row: dict[str, Any], data: dict[str, Any], cache: dict[Any, Any]):
    """The planner's prediction of one measured row: the step-time model with the default
    factors for the catalogue's GPU, slowed near the usable memory as the planner does."""
    from autoshard.config import Candidate, Hardware, WorkloadSpec
    from autoshard.predict.analytic import estimate_memory
    from autoshard.predict.optimizer_step import HOST_OPTIMIZER_THREADS
    from autoshard.predict.speed import predict_speed, under_pressure

    profile, flops, acts, linears = _profiles(run["model"]["size"], run["seq_len"], cache)
    candidate = Candidate.model_validate(row["candidate"])
    assert candidate.label() == row["label"], (candidate.label(), row["label"])
    hardware = Hardware(
        gpus_per_node=data["gpus_per_node"], nodes=data["nodes"],
        gpu_memory=run["gpu_memory"], gpu=data["gpu"],
    )  # fmt: skip
    workload = WorkloadSpec(
        seq_len=run["seq_len"], micro_batch_size=candidate.micro_batch_size,
        accumulate=run["accumulate"],
    )  # fmt: skip
    # autoshard's trials: each rank's host optimizer on the worker group's OMP_NUM_THREADS=4
    speed = predict_speed(
        profile, flops, candidate, hardware, workload, linears=linears,
        host_threads=HOST_OPTIMIZER_THREADS,
    )  # fmt: skip
    memory = estimate_memory(profile, candidate, hardware, workload, activations=acts)
    return under_pressure(speed, memory.gpu_peak, hardware.usable_gpu_memory), memory


def evaluate(
    data: dict[str, Any] | None = None, cache: dict[Any, Any] | None = None
) -> list[dict[str, Any]]:
    """Every measured row with its prediction and set, in the shape the published rows have
    (``published`` and ``predicted`` tokens/s per GPU, ``error`` = predicted / measured - 1:
    positive where the model is too fast)."""
    data = data or json.loads(DATA.read_text())
    sets = split(data)
    cache = {} if cache is None else cache
    rows = []
    for run in data["runs"]:
        for row in run["rows"]:
            speed, memory = predict(run, row, data, cache)
            tokens = row["candidate"]["micro_batch_size"] * run["seq_len"]
            rows.append(
                {
                    "run": run,
                    "row": row,
                    "group": {"id": run["id"], "source": data["gpu"] + " runs"},
                    "set": sets[configuration(run, row)],
                    "configuration": configuration(run, row),
                    "label": f"{run['model']['size']} {row['label']}",
                    "measured_s": row["step_time_s"],
                    "published": tokens / row["step_time_s"],
                    "predicted": tokens / speed.step_time_s,
                    "error": row["step_time_s"] / speed.step_time_s - 1,
                    "speed": speed,
                    "memory": memory,
                    "params": float(
                        _profiles(run["model"]["size"], run["seq_len"], cache)[0].total_params
                    ),
                    "gpu": data["gpu"],
                    "precision": row["candidate"]["precision"],
                }
            )
    return rows


def row_line(row: dict[str, Any], target: float) -> str:
    speed, part = row["speed"], row["speed"].breakdown
    mfu = f"{speed.mfu:.0%}" if speed.mfu is not None else ""
    return (
        f"| {row['group']['id']} | {row['label']} | {row['measured_s'] * 1e3:,.1f} | "
        f"{speed.step_time_s * 1e3:,.1f} | {row['error']:+.1%} | "
        f"{'yes' if abs(row['error']) <= target else 'NO'} | {mfu} | "
        f"{part.compute_s * 1e3:.1f} | {part.recompute_s * 1e3:.1f} | "
        f"{part.host_bound_s * 1e3:.1f} | {part.optimizer_s * 1e3:.1f} | "
        f"{part.offload_s * 1e3:.1f} | {part.pressure_s * 1e3:.1f} |"
    )


def table(rows: list[dict[str, Any]], target: float) -> list[str]:
    """The rows of one set: measured against predicted milliseconds, and the breakdown."""
    return [
        "| run | configuration | measured ms | predicted ms | error (tokens/s) | within "
        f"{target:.0%} | predicted MFU | compute ms | recompute ms | host-bound ms | "
        "optimizer ms | offload ms | pressure ms |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(row_line(row, target) for row in rows),
    ]


def summary(
    name: str, rows: list[dict[str, Any]], order_check: Any, target: float
) -> tuple[str, list[str]]:
    """(the summary line, the order lines) of one GPU set, as the published sets say them:
    rows within ``target``, the median and largest error, and the runs whose configurations
    measured more than 5% apart ordered right (``order_check``: the published benchmark's)."""
    if not rows:
        return f"**{name}**: no rows", []
    runs: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        runs.setdefault(row["group"]["id"], []).append(row)
    orders, ordered, with_pairs = [], 0, 0
    for rid, members in runs.items():
        right, compared, wrong = order_check(members)
        if compared:
            with_pairs += 1
            ordered += right == compared
        verdict = "right" if right == compared else "WRONG: " + "; ".join(wrong)
        orders.append(f"- {rid}: {right}/{compared} pairs in order, {verdict}")
    absolute = sorted(abs(row["error"]) for row in rows)
    within = sum(a <= target for a in absolute)
    median = (
        absolute[len(absolute) // 2]
        if len(absolute) % 2
        else ((absolute[len(absolute) // 2 - 1] + absolute[len(absolute) // 2]) / 2)
    )
    line = (
        f"**{name}**: {len(rows)} measured rows ({len({r['configuration'] for r in rows})} "
        f"configurations) in {len(runs)} runs; within {target:.0%}: {within}/{len(rows)} "
        f"({within / len(rows):.0%}); median |error| {median:.0%}, max {absolute[-1]:.0%}; "
        f"runs with a pair measured >5% apart ordered right: {ordered}/{with_pairs}"
    )
    return line, orders


def split_lines(data: dict[str, Any]) -> list[str]:
    sets = split(data)
    classes: dict[tuple[str, str, bool, bool], list[str]] = {}
    for run in data["runs"]:
        for row in run["rows"]:
            text = configuration(run, row)
            members = classes.setdefault(stratum(run, row), [])
            if text not in members:
                members.append(text)
    lines = [
        "GPU rows split by configuration (`step_time_gpu.split`: within each class of model, "
        "precision, float8 and offload, the configurations in sha256 order, alternately "
        "fitting and held-out, the first fitting), fixed before the model changed for them:",
        "",
    ]
    for key, members in classes.items():
        size, precision, float8, offload = key
        name = f"{size} {precision}" + " float8" * float8 + " offload" * offload
        lines.append(f"- {name}: " + "; ".join(f"{m} ({sets[m]})" for m in members))
    return [*lines, ""]


if __name__ == "__main__":
    import argparse
    import sys

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    sys.path.insert(0, str(ROOT))
    data = json.loads(DATA.read_text())
    rows = evaluate(data)
    print("\n".join(split_lines(data)))
    for name in ("fitting", "held-out"):
        members = [row for row in rows if row["set"] == name]
        print(f"### GPU {name}\n")
        print("\n".join(table(members, 0.25)))
        print()
