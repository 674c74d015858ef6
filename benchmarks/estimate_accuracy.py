"""Benchmark: both memory estimators against peaks measured in real multi-process gloo runs.

    python benchmarks/estimate_accuracy.py [--quick] [--reuse] \\
        [--write benchmarks/results/estimate_accuracy_cpu.md]

For every configuration of a grid (two model shapes, both engines, three sharding strategies,
checkpointing on and off, fp32 and bf16 mixed precision, two micro-batch sizes; FSDP2's reshard
policies; a tiny Mixtral, mixture of experts), all in a plain loop (``zero_grad`` after
``step``), and of the user's loops (issue 14: Lightning's order, gradient accumulation over 4
micro-batches in both loops, a frozen embedding, a Llama with LoRA adapters), it compares:
- measured: one ``torch.distributed.run`` group of 2 gloo processes runs each configuration for
  real, built and sharded exactly as a trial does (``autoshard.trials.worker.build_sharded``),
  for two training steps under torch's own memory tracker
  (``autoshard.predict.simulate.track_training_peak``);
  the peak is the largest over the ranks;
- simulated: :func:`autoshard.predict.simulate.simulate_memory` (fake tensors, fake process group);
- analytic: :func:`autoshard.predict.analytic.estimate_memory`.
Both estimates are compared without their GPU allowance (CUDA context and allocator slack, which
a CPU run cannot show). Targets (issue 14): simulated within 3%, analytic within 5%, everywhere.
On a GPU machine, ``--device cuda`` measures with ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` instead (NCCL, one process per GPU).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from results_file import write_results  # benchmarks/, the script's own folder

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:build"
# Two shapes: a wide-vocabulary shallow model (the loss and the embedding weigh most) and a
# deeper, wider one with a smaller vocabulary (blocks and activations weigh most).
SHAPES = {
    "gpt-tiny": ({"size": "tiny"}, 128),
    "gpt-deep": (
        {"size": "tiny", "n_layer": 8, "d_model": 256, "n_head": 4, "vocab_size": 2048},
        64,
    ),
}
# Shapes built by another example than gpt.py: a mixture-of-experts model (4 experts, 2 per
# token), whose own batch (one sequence of 128 tokens) the measurement and both estimates use.
SPECS = {"mixtral-tiny": f"{ROOT}/examples/hf_mixtral.py:build"}
SHAPES["mixtral-tiny"] = ({"size": "tiny", "batch_size": 1, "seq_len": 128}, 128)
# A Llama with rank-8 LoRA adapters on q_proj and v_proj: only the adapters train.
SPECS["llama-lora"] = f"{ROOT}/examples/hf_llama_lora.py:build"
SHAPES["llama-lora"] = (
    {"size": "tiny", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
     "vocab_size": 2048, "batch_size": 1, "seq_len": 64},
    64,
)  # fmt: skip
# Selective checkpointing needs a step whose activations weigh (the shapes above peak at the
# loss or the optimizer): a GPT and a Llama at 512 tokens.
SHAPES["gpt-long"] = ({"size": "tiny", "vocab_size": 1024, "max_seq_len": 512}, 512)
# A Llama (Hugging Face's: bias-free linear layers, SwiGLU, rotary SDPA) for selective
# checkpointing beside the GPT, whose MLP has biases (aten.addmm against aten.mm).
SPECS["llama-tiny"] = f"{ROOT}/examples/hf_llama.py:build"
SHAPES["llama-tiny"] = (
    {"size": "tiny", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
     "vocab_size": 1024, "batch_size": 1, "seq_len": 512},
    512,
)  # fmt: skip
# Keys of a point that are not Candidate fields: the training loop and the target's variant.
# A point without "loop" ran in a plain loop (every point before issue 14).
WORKLOAD_KEYS = ("loop", "accumulate")
TARGET_KEYS = ("freeze",)
RESULTS = ROOT / "benchmarks" / "results"


def grid(quick: bool, world: int = 2) -> list[dict[str, Any]]:
    points = []
    for shape, engine, sharding, ckpt, precision, mbs in itertools.product(
        ("gpt-tiny", "gpt-deep"),
        ("fsdp1", "fsdp2"),
        ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
        ("none", "all"),
        ("32-true", "bf16-mixed"),
        (1, 2),
    ):
        if quick and (mbs == 2 or ckpt == "all" or sharding == "NO_SHARD"):
            continue
        if mbs == 2 and sharding != "FULL_SHARD":
            continue  # the micro-batch scales activations alike under every sharding
        points.append(
            dict(shape=shape, engine=engine, sharding=sharding, checkpointing=ckpt,
                 precision=precision, micro_batch_size=mbs)
        )  # fmt: skip
    # A few more settings, once each: hybrid sharding, bf16-true, SGD, for-loop AdamW.
    for extra in (
        dict(sharding="HYBRID_SHARD", hybrid_mesh=(1, world)),
        dict(precision="bf16-true"),
        dict(optimizer="sgd"),
        dict(optimizer_impl="for_loop"),
    ):
        for engine in ("fsdp1", "fsdp2"):
            base = dict(shape="gpt-deep", engine=engine, sharding="FULL_SHARD",
                        checkpointing="none", precision="bf16-mixed",
                        micro_batch_size=1)  # fmt: skip
            points.append({**base, **extra})
    # FSDP2's reshard policies: the root (embedding and head: the wide-vocabulary shape's
    # largest unit), or the root and the last block, kept gathered after forward.
    for shape, reshard, precision in itertools.product(
        ("gpt-tiny", "gpt-deep"), ("keep_root", "keep_root_and_last"), ("32-true", "bf16-mixed")
    ):
        points.append(dict(shape=shape, engine="fsdp2", sharding="FULL_SHARD", checkpointing="none",
                           precision=precision, micro_batch_size=1, reshard=reshard))  # fmt: skip
    # A mixture-of-experts model: routed experts' activations (balanced routing).
    for engine, sharding, ckpt, precision, reshard in (
        ("fsdp1", "FULL_SHARD", "none", "32-true", "all"),
        ("fsdp1", "FULL_SHARD", "none", "bf16-mixed", "all"),
        ("fsdp2", "FULL_SHARD", "none", "32-true", "all"),
        ("fsdp2", "FULL_SHARD", "none", "bf16-mixed", "all"),
        ("fsdp2", "FULL_SHARD", "all", "32-true", "all"),
        ("fsdp2", "SHARD_GRAD_OP", "none", "32-true", "all"),
        ("fsdp2", "FULL_SHARD", "none", "32-true", "keep_root"),
    ):
        point = dict(shape="mixtral-tiny", engine=engine, sharding=sharding, checkpointing=ckpt,
                     precision=precision, micro_batch_size=1)  # fmt: skip
        points.append({**point, **({"reshard": reshard} if reshard != "all" else {})})
    return points + selective_points(quick) + loop_points(quick)


def selective_points(quick: bool) -> list[dict[str, Any]]:
    """Issue 23: selective (op-level) checkpointing on two shapes, both engines, fp32 and bf16
    mixed precision, and once at SHARD_GRAD_OP and micro-batch 2."""
    shapes = ("gpt-long",) if quick else ("gpt-long", "llama-tiny")
    points = [
        dict(shape=shape, engine=engine, sharding="FULL_SHARD", checkpointing="selective",
             precision=precision, micro_batch_size=1)
        for shape, engine, precision in itertools.product(
            shapes, ("fsdp1", "fsdp2"), ("32-true", "bf16-mixed"))
    ]  # fmt: skip
    if not quick:
        for engine in ("fsdp1", "fsdp2"):
            points.append(dict(shape="llama-tiny", engine=engine, sharding="SHARD_GRAD_OP",
                               checkpointing="selective", precision="bf16-mixed",
                               micro_batch_size=2))  # fmt: skip
    return points


def loop_points(quick: bool) -> list[dict[str, Any]]:
    """Issue 14: the loop the user runs. Lightning's order (the last step's gradients alive
    through the next forward), accumulation over 4 micro-batches in Lightning's order and in a
    plain loop, a frozen embedding, and LoRA adapters (frozen base weights)."""
    shapes = ("gpt-tiny",) if quick else ("gpt-tiny", "gpt-deep")
    engines, shardings = ("fsdp1", "fsdp2"), ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
    precisions = ("32-true", "bf16-mixed")

    def point(shape: str, engine: str, sharding: str, precision: str, **extra: Any) -> dict:
        return dict(shape=shape, engine=engine, sharding=sharding,
                    checkpointing=extra.pop("checkpointing", "none"), precision=precision,
                    micro_batch_size=1, **extra)  # fmt: skip

    points = []
    for shape, engine, sharding, precision in itertools.product(
        shapes, engines, shardings, precisions
    ):
        points.append(point(shape, engine, sharding, precision, loop="lightning"))
    if not quick:
        for engine, sharding in itertools.product(engines, ("FULL_SHARD", "SHARD_GRAD_OP")):
            points.append(point("gpt-deep", engine, sharding, "32-true", loop="lightning",
                                checkpointing="all"))  # fmt: skip
    for shape, engine, sharding, precision, loop in itertools.product(
        shapes, engines, shardings, precisions, ("lightning", "plain")
    ):
        points.append(point(shape, engine, sharding, precision, loop=loop, accumulate=4))
    variants = [("gpt-tiny", {"freeze": "tok_emb"})] + ([] if quick else [("llama-lora", {})])
    for (shape, variant), engine, sharding, precision, loop in itertools.product(
        variants, engines, shardings, precisions, ({"loop": "lightning"},
        {"loop": "plain", "accumulate": 4})
    ):  # fmt: skip
        points.append(point(shape, engine, sharding, precision, **loop, **variant))
    return points


def candidate_of(point: dict[str, Any], profile: Any) -> Any:
    from autoshard.config import Candidate

    skip = {"shape", *WORKLOAD_KEYS, *TARGET_KEYS}
    fields = {k: v for k, v in point.items() if k not in skip}
    return Candidate(
        wrap_classes=profile.wrap_policy, checkpoint_classes=profile.checkpoint_policy, **fields
    )


def target_of(shape: str, **variant: Any) -> Any:
    from autoshard.target.resolve import TargetSpec

    return TargetSpec(spec=SPECS.get(shape, GPT), kwargs={**SHAPES[shape][0], **variant})


def target_of_point(point: dict[str, Any]) -> Any:
    return target_of(point["shape"], **{k: point[k] for k in TARGET_KEYS if k in point})


def workload_of(point: dict[str, Any]) -> Any:
    """The point's workload: its loop (plain where it names none) and accumulation."""
    from autoshard.config import WorkloadSpec

    return WorkloadSpec(
        seq_len=SHAPES[point["shape"]][1],
        loop=point.get("loop", "plain"),
        accumulate=point.get("accumulate", 1),
    )


# ---------------------------------------------------------------------------------------------
# Worker: runs under torch.distributed.run, measures every point for real
# ---------------------------------------------------------------------------------------------


def worker(points_path: Path, out_path: Path, device_kind: str) -> None:
    import torch
    import torch.distributed as dist

    from autoshard.analyze import analyze_target
    from autoshard.predict.simulate import measure_training_peak
    from autoshard.trials.worker import exit_worker

    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
    rank = dist.get_rank()
    if device_kind == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    points = json.loads(points_path.read_text())
    shapes = dict.fromkeys(point["shape"] for point in points)  # only the shapes measured
    profiles = {shape: analyze_target(target_of(shape))[0] for shape in shapes}
    results = []
    for point in points:
        candidate = candidate_of(point, profiles[point["shape"]])
        record: dict[str, Any] = {"point": point}
        try:
            baseline = cuda_baseline(device) if device.type == "cuda" else None
            kinds = measure_training_peak(
                target_of_point(point), candidate, workload_of(point), device
            )
            record["tracked"] = kinds["Total"]
            if baseline is not None:
                record.update(cuda_peaks(device, baseline))
        except Exception as exc:  # a failed point is a result, not the end of the benchmark
            record["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        gc.collect()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, record)
        if rank == 0:
            merged = dict(record)
            for key in ("tracked", "allocated", "reserved"):
                values = [g[key] for g in gathered if key in g]
                if values:
                    merged[key] = max(values)
            errors = [g["error"] for g in gathered if "error" in g]
            if errors:
                merged["error"] = errors[0]
            results.append(merged)
            out_path.write_text(json.dumps(results))
            print(f"measured {len(results)}/{len(points)}", flush=True)
    exit_worker()


def cuda_baseline(device: Any) -> dict[str, int]:
    """What the CUDA allocator holds before a point (the earlier points' leftovers, the
    profiles), its peaks then reset to it: a point's peak is what it adds to this."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
    }


def cuda_peaks(device: Any, baseline: dict[str, int]) -> dict[str, int]:
    """A point's allocated and reserved peaks above its baseline, and the baseline itself (a
    baseline that grows from point to point is a leak between points)."""
    import torch

    return {
        "allocated": torch.cuda.max_memory_allocated(device) - baseline["allocated"],
        "reserved": torch.cuda.max_memory_reserved(device) - baseline["reserved"],
        "baseline_allocated": baseline["allocated"],
        "baseline_reserved": baseline["reserved"],
    }


def _key(point: dict[str, Any]) -> str:
    return json.dumps(point, sort_keys=True)  # tuples and lists alike


def _larger(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The record with the larger peak of two measurements of one point (a failed one loses)."""
    if old is None or "error" in old:
        return new
    if "error" in new:
        return old
    return {k: max(old[k], new[k]) if k in old and k in new and k != "point" else new[k]
            for k in new}  # fmt: skip


def world_size(device_kind: str, given: int | None = None) -> int:
    """2 gloo processes on CPU; on CUDA one process per GPU, at most 2 (NCCL refuses two ranks
    on one GPU, so a one-GPU machine measures at world size 1, and the estimates plan for 1).
    ``given`` (--world): the world of saved measurements estimated elsewhere (no GPU needed)."""
    if given is not None:
        return given
    if device_kind == "cpu":
        return 2
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("estimate_accuracy: --device cuda, but torch sees no GPU")
    return min(2, torch.cuda.device_count())


def measure(
    points: list[dict[str, Any]], device_kind: str, nproc: int, out_path: Path
) -> list[dict[str, Any]]:
    """Measure ``points`` in one group; the worker rewrites ``out_path`` after every point, so a
    run stopped midway (gpu.sh's time box) keeps what it measured."""
    from autoshard.child_env import child_env

    with tempfile.TemporaryDirectory() as tmp:
        points_path = Path(tmp, "points.json")
        points_path.write_text(json.dumps(points))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.unlink(missing_ok=True)  # an earlier run's
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", __file__, "--worker", str(points_path), str(out_path),
            "--device", device_kind,
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=ROOT, env=child_env(ROOT / "examples", ROOT))
        return list(json.loads(out_path.read_text()))


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def estimate(points: list[dict[str, Any]], device_kind: str, world: int) -> list[tuple[int, int]]:
    """(analytic, simulated) bytes without the allowance, for every point, planned for the
    backend the measurements ran on."""
    from autoshard.analyze import analyze_target
    from autoshard.config import Hardware, Precision, WorkloadSpec
    from autoshard.predict.activations import profile_activations
    from autoshard.predict.analytic import estimate_memory
    from autoshard.predict.simulate import simulate_memory

    backend = "nccl" if device_kind == "cuda" else "gloo"
    hardware = Hardware(gpus_per_node=world, gpu_memory=80 * 1024**3, backend=backend)
    cache: dict[str, Any] = {}
    out: list[tuple[int, int]] = []
    for point in points:
        target = target_of_point(point)
        if str(target) not in cache:
            profile, built = analyze_target(target)
            workload = WorkloadSpec(seq_len=SHAPES[point["shape"]][1])
            precisions = tuple(Precision)
            acts = profile_activations(
                built.model, profile, workload, built.batch, precisions=precisions
            )
            cache[str(target)] = (profile, acts)
        profile, acts = cache[str(target)]
        candidate = candidate_of(point, profile)
        workload = workload_of(point)
        ana = estimate_memory(profile, candidate, hardware, workload, activations=acts)
        sim = simulate_memory(
            target, candidate, hardware, workload, block_classes=profile.block_classes
        )
        out.append((ana.gpu_peak - ana.breakdown.allowance, sim.gpu_peak - sim.breakdown.allowance))
    return out


def _labelled(point: dict[str, Any], wanted: list[str]) -> bool:
    """Whether the point's label has all the words of one of ``wanted``."""
    return any(set(words.split()) <= set(label(point).split()) for words in wanted)


def label(point: dict[str, Any]) -> str:
    skip = {"shape", "engine", "sharding", "checkpointing", "precision", "micro_batch_size"}
    extra = " ".join(f"{k}={v}" for k, v in point.items() if k not in skip)
    ckpt = {"none": "", "selective": " ckpt-op"}.get(point["checkpointing"], " ckpt")
    return (
        f"{point['shape']} {point['engine']} {point['sharding']} {point['precision']}{ckpt} "
        f"mbs{point['micro_batch_size']} {extra}"
    ).strip()


def report(
    points: list[dict[str, Any]],
    measured: list[dict[str, Any]],
    estimates: list[tuple[int, int]],
    device_kind: str,
) -> str:
    mib = 1024**2
    key = "allocated" if device_kind == "cuda" else "tracked"
    lines = [
        "| configuration | measured MiB | analytic MiB | error | simulated MiB | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    errors: dict[tuple[str, str], list[float]] = {}
    for point, m, (ana, sim) in zip(points, measured, estimates, strict=True):
        if "error" in m or key not in m:
            lines.append(f"| {label(point)} | failed: {m.get('error')} | | | | |")
            continue
        real = m[key]
        group = "the user's loop" if "loop" in point else "plain loop"
        ea = 100 * (ana - real) / real
        errors.setdefault((group, "analytic"), []).append(abs(ea))
        es = 100 * (sim - real) / real
        errors.setdefault((group, "simulated"), []).append(abs(es))
        simulated = f"{sim / mib:.1f} | {es:+.1f}%"
        shown = f"{real / mib:.1f}"
        if "baseline_allocated" in m:  # CUDA: the tracker's count beside the allocator's
            shown += f" (tracked {m['tracked'] / mib:.1f})"
        lines.append(f"| {label(point)} | {shown} | {ana / mib:.1f} | {ea:+.1f}% | {simulated} |")
    lines += ["", "| points | estimator | points | median abs error | max abs error | "
              "within target |", "| --- | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for group in ("plain loop", "the user's loop"):
        for name, target in (("analytic", 5.0), ("simulated", 3.0)):
            errs = errors.get((group, name), [])
            if errs:
                lines.append(
                    f"| {group} | {name} | {len(errs)} | {statistics.median(errs):.1f}% | "
                    f"{max(errs):.1f}% | {sum(e <= target for e in errs)}/{len(errs)} within "
                    f"{target:.0f}% |"
                )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="A smaller grid (a fast check).")
    parser.add_argument("--write", type=Path, help="Write the table as markdown here.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--reuse", action="store_true", help="Reuse the saved measurements of the same points."
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS,
        help="Where the measurements are saved (and reused from), before the estimates run.",
    )
    parser.add_argument(
        "--remeasure",
        action="append",
        default=[],
        metavar="WORDS",
        help="With --reuse: measure again the points whose label has all these words (e.g. "
        "'fsdp2 FULL_SHARD'), keeping the larger peak of the saved and the new runs. Repeatable.",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="Measure each point this many times and keep its largest peak: a peak that "
        "depends on thread timing (gloo's all-gather race, see the results' Findings).",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="WORDS",
        help="Only the points whose label has all these words (e.g. 'ckpt-op 32-true'); the "
        "saved measurements of the others are kept. Repeatable: a point matching any.",
    )
    parser.add_argument(
        "--measure-only",
        action="store_true",
        help="Save the measurements and stop (a GPU lease: estimate them later, elsewhere, with "
        "--reuse --world N and the same --results-dir).",
    )
    parser.add_argument(
        "--world",
        type=int,
        help="The world size of the saved measurements (with --reuse: no GPU needed to estimate "
        "CUDA measurements); by default what runs here.",
    )
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def measured_points(
    args: argparse.Namespace, points: list[dict[str, Any]], world: int, saved: Path
) -> tuple[list[dict[str, Any]], str]:
    """Every point's measurement (saved ones reused where asked), saved again; and a sentence
    saying how. While measuring, the worker writes ``<saved>.partial.json`` point by point."""
    start = time.perf_counter()
    previous = json.loads(saved.read_text()) if args.reuse and saved.exists() else []
    # Reused point by point: a grid that grew measures only its new points.
    by_point = {_key(m["point"]): m for m in previous if "error" not in m}
    remeasured = [p for p in points if _key(p) in by_point and _labelled(p, args.remeasure)]
    missing = [p for p in points if _key(p) not in by_point] + remeasured
    partial = saved.with_suffix(".partial.json")
    for _ in range(args.repeat if missing else 0):
        for m in measure(missing, args.device, world, partial):
            by_point[_key(m["point"])] = _larger(by_point.get(_key(m["point"])), m)
    measured = [by_point[_key(p)] for p in points]
    if missing:
        saved.parent.mkdir(parents=True, exist_ok=True)
        records = measured
        if args.only:  # a subset: the other points' saved measurements stay
            everything = {_key(m["point"]): m for m in previous}
            everything.update({_key(m["point"]): m for m in measured})
            records = list(everything.values())
        saved.write_text(json.dumps(records, indent=1) + "\n")
        partial.unlink(missing_ok=True)
    shown = saved.relative_to(ROOT) if saved.is_relative_to(ROOT) else saved
    parts = []
    if len(missing) < len(points) or remeasured:
        reused = len(points) - len(missing) + len(remeasured)
        parts.append(f"{reused} measurements reused from `{shown}`")
    if missing:
        again = f" ({len(remeasured)} of them again)" if remeasured else ""
        times = f", {args.repeat} times each," if args.repeat > 1 else ""
        parts.append(
            f"{len(missing)} measured{again}{times} in {time.perf_counter() - start:.0f} s"
        )
    return measured, ", ".join(parts)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.device)
        return
    import torch

    world = world_size(args.device, args.world)
    points = [p for p in grid(args.quick, world) if not args.only or _labelled(p, args.only)]
    # Measurements are kept (and committed beside the table): a failure in the estimates, or a
    # rerun with a changed estimator, does not cost the measuring again.
    suffix = ("_quick" if args.quick else "") + ("" if world == 2 else f"_world{world}")
    saved = args.results_dir / f"estimate_accuracy_measured_{args.device}{suffix}.json"
    measured, how = measured_points(args, points, world, saved)
    if args.measure_only:
        failed = sum("error" in m for m in measured)
        print(f"{len(points)} points: {how}; {failed} failed; saved in {saved}")
        return
    start = time.perf_counter()
    estimates = estimate(points, args.device, world)
    estimated_s = time.perf_counter() - start
    table = report(points, measured, estimates, args.device)
    header = (
        f"{len(points)} configurations on {world} {args.device} processes "
        f"({'gloo' if args.device == 'cpu' else 'nccl'}), torch {torch.__version__}; {how}, "
        f"estimated (analytic + simulated) in {estimated_s:.0f} s. "
        "Estimates are planned for the same backend and exclude their GPU allowance."
    )
    print(header)
    print(table)
    if args.write:
        command = " ".join(["python", "benchmarks/estimate_accuracy.py", *sys.argv[1:]])
        write_results(
            args.write,
            f"# Memory estimators against measured peaks ({args.device})\n\n`{command}`\n\n"
            f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores. {header}\n\n"
            f"Measured: torch's memory tracker around two real training steps per configuration "
            f"(the largest rank).\n\n{table}\n",
        )


if __name__ == "__main__":
    main()
