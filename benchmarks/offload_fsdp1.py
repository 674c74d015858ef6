"""Benchmark: FSDP1 CPU offload's device memory, estimated against FSDP1's offload run on CPU
processes (:mod:`autoshard.predict.offload_emulation`), on 1 and 2 gloo ranks.

    python benchmarks/offload_fsdp1.py [--write benchmarks/results/offload_fsdp1_emulated.md]

Each grid point is an offloading FSDP1 candidate of a model of ``examples/gpt.py``, trained for
three steps as a trial trains it, with torch's own FSDP1 code; the emulation makes each
host-to-device move of a unit's shard a real copy (as on a GPU) and counts every storage but
the ones FSDP1 keeps on the host. The estimate is ``estimate_memory`` planned for the same gloo
ranks (no allowance: nothing CUDA-only is counted on either side).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from autoshard.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/gpt.py:build"
# a GPT-2-style tiny model whose peak is in backward, and a Llama-shaped one (RMSNorm, SwiGLU,
# grouped-query attention) at 512 tokens whose peak is the loss
MODELS = {
    "tiny s128": ({"size": "tiny"}, 128),
    "llama-shaped s512": (
        {"size": "1b", "n_layer": 4, "d_model": 256, "n_head": 8, "n_kv_head": 2,
         "ffn_hidden": 1024, "vocab_size": 8000},
        512,
    ),
}  # fmt: skip
EVERY2 = {"checkpointing": "every_k", "checkpoint_every": 2}
POINTS = [
    {"precision": "32-true", **EVERY2},
    {"precision": "32-true"},
    {"precision": "32-true", "checkpointing": "all"},
    {"precision": "bf16-mixed", **EVERY2},
    {"precision": "bf16-mixed"},
    {"precision": "bf16-true"},
    {"precision": "32-true", "sharding": "SHARD_GRAD_OP"},
]


def measure(model: str, ranks: int) -> list[dict]:
    """The grid of ``model`` on ``ranks`` gloo processes: each point's emulated peak (the
    largest rank's) and its estimate."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "points.json"
        env = child_env(ROOT / "examples", ROOT, OMP_NUM_THREADS="1")
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
             "--standalone", __file__, "--worker", model, str(out)],
            env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
        return json.loads(out.read_text())


def worker(model: str, out: Path) -> None:
    import torch.distributed as dist

    from autoshard.analyze import analyze_target
    from autoshard.config import Candidate, Hardware, WorkloadSpec
    from autoshard.predict.activations import profile_activations
    from autoshard.predict.analytic import estimate_memory
    from autoshard.predict.offload_emulation import measure_offload_peak
    from autoshard.target.resolve import TargetSpec
    from autoshard.trials.worker import exit_worker

    kwargs, seq = MODELS[model]
    target = TargetSpec(spec=GPT, kwargs=kwargs)
    profile, built = analyze_target(target)
    workload = WorkloadSpec(seq_len=seq)
    dist.init_process_group("gloo")
    ranks = dist.get_world_size()
    gloo = Hardware(gpus_per_node=ranks, gpu_memory=80 * 2**30, backend="gloo")
    rows = []
    for point in POINTS:
        candidate = Candidate(
            wrap_classes=profile.wrap_policy, checkpoint_classes=profile.checkpoint_policy,
            cpu_offload=True, **point,
        )  # fmt: skip
        peak = measure_offload_peak(target, candidate, workload)
        peaks: list = [None] * ranks
        dist.all_gather_object(peaks, (peak.bytes, peak.at))
        if dist.get_rank() == 0:
            acts = profile_activations(
                built.model, profile, workload, precisions=(candidate.precision,)
            )
            est = estimate_memory(profile, candidate, gloo, workload, activations=acts)
            emulated, at = max(peaks)
            rows.append(
                dict(label=candidate.label(), emulated=emulated, at=at,
                     estimate=est.gpu_peak, estimate_at=est.peak_at)
            )  # fmt: skip
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows))
    exit_worker()


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| model | ranks | candidate | emulated peak | estimate | error | estimate's moment | "
        "emulated at |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for key, rows in results.items():
        model, ranks = key.rsplit(" x", 1)
        for r in rows:
            error = r["estimate"] / r["emulated"] - 1
            lines.append(
                f"| {model} | {ranks} | {r['label']} | {r['emulated'] / 2**20:.3f} MiB | "
                f"{r['estimate'] / 2**20:.3f} MiB | {error:+.1%} | {r['estimate_at']} | "
                f"{r['at']} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="write the table to this markdown file")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return
    results = {f"{m} x{n}": measure(m, n) for m in MODELS for n in (1, 2)}
    errors = [r["estimate"] / r["emulated"] - 1 for rows in results.values() for r in rows]
    text = (
        "# FSDP1 CPU offload: estimated against FSDP1's offload run on CPU processes\n\n"
        "`python benchmarks/offload_fsdp1.py --write benchmarks/results/offload_fsdp1_emulated.md`"
        "\n\n" + table(results) + f"\n\n{len(errors)} points; error "
        f"{min(errors):+.1%} .. {max(errors):+.1%}.\n"
    )
    print(text)
    if args.write:
        args.write.write_text(text)


if __name__ == "__main__":
    main()
