"""Benchmark: the reserved peak (``torch.cuda.max_memory_reserved``) against
:func:`autoshard.predict.analytic.estimate_reserved`, on the GPUs here.

    python benchmarks/reserved_memory_measured.py [--write OUT/reserved_memory_gpu.md]

The number torchtitan's published memory column is (its ``max_reserved``), measured on a step
shaped like torchtitan's: a Llama-shaped ``examples/gpt.py`` with torchtitan's projection layout
and a 128k vocabulary, FSDP2 FULL_SHARD, bf16-mixed (fp32 reduce), op-level selective
checkpointing, torchtitan's loss (``cross_entropy(pred.flatten(0, 1).float(), ...)`` then
``del pred``), zero_grad after the step. Once with PyTorch's default allocator and once with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (torchtitan's run script sets it), each in a
fresh process group (NCCL, one process per visible GPU), three steps. Prints the measured
allocated and reserved peaks beside the estimate's allocated peak, its stream pools and loss's
hole: what the planner's allowance should count of the reserved peak is read from here.

``benchmarks/gpu.sh accuracy`` runs it; without CUDA it says so and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from results_file import write_results  # benchmarks/, the script's own folder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPE = {
    "n_layer": 8, "n_head": 16, "n_kv_head": 4, "d_model": 2048, "ffn_hidden": 7168,
    "vocab_size": 128256, "mlp": "swiglu", "max_seq_len": 4096, "fused_projections": False,
}  # fmt: skip
SEQ, MBS, STEPS = 4096, 2, 3


def candidate(profile):  # type: ignore[no-untyped-def]
    from autoshard.config import Candidate

    return Candidate(
        engine="fsdp2", wrap_classes=profile.wrap_policy, precision="bf16-mixed",
        checkpointing="selective", checkpoint_classes=profile.wrap_policy, micro_batch_size=MBS,
    )  # fmt: skip


def worker(out: Path) -> None:
    """One rank's three steps; rank 0 writes the peaks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from autoshard.analyze import analyze_model
    from autoshard.sharding import apply_candidate
    from examples.gpt import GPT

    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    with torch.device("meta"):
        model = GPT(**SHAPE)
    profile = analyze_model(model)
    # materialised on the GPU after sharding; values do not change the bytes, only NaN-free steps
    model = apply_candidate(model, candidate(profile), device, param_init_fn=lambda _: None)
    model.reset_parameters()
    for name, param in model.named_parameters():
        if "norm" in name:
            torch.nn.init.ones_(param)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, SHAPE["vocab_size"], (MBS, SEQ + 1), device=device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(STEPS):
        pred = model(tokens[:, :-1])
        loss = F.cross_entropy(pred.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))
        del pred  # torchtitan's train loop: "need to free to before bwd to avoid peaking memory"
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stats = torch.cuda.memory_stats(device)
    if rank == 0:
        out.write_text(
            json.dumps(
                {
                    "allocated": stats["allocated_bytes.all.peak"],
                    "active": stats["active_bytes.all.peak"],
                    "reserved": stats["reserved_bytes.all.peak"],
                    "world": dist.get_world_size(),
                }
            )
        )
    dist.destroy_process_group()


def measure(expandable: bool, gpus: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peaks.json"
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if expandable:
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}"]
        command += [__file__, "--worker", str(out)]
        subprocess.run(command, check=True, env=env, cwd=ROOT)
        return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("reserved_memory_measured.py: no CUDA GPU here (run it with benchmarks/gpu.sh)")
    from autoshard.analyze import analyze_model
    from autoshard.config import Hardware, WorkloadSpec
    from autoshard.predict.activations import profile_activations
    from autoshard.predict.analytic import estimate_reserved
    from examples.gpt import GPT

    gpus = torch.cuda.device_count()
    with torch.device("meta"):
        model = GPT(**SHAPE)
    profile = analyze_model(model)
    workload = WorkloadSpec(seq_len=SEQ, loop="plain")
    acts = profile_activations(model, profile, workload, precisions=["bf16-mixed"])
    memory = torch.cuda.get_device_properties(0).total_memory
    hardware = Hardware(gpus_per_node=gpus, gpu_memory=memory)
    peak = estimate_reserved(profile, candidate(profile), hardware, workload, activations=acts)
    gib = 2**30
    lines = [
        f"{gpus} x {torch.cuda.get_device_name()}, torch {torch.__version__}; {SHAPE}, "
        f"{MBS} x {SEQ} tokens per GPU",
        "",
        f"Estimate: allocated {peak.allocated / gib:.2f} GiB, stream pools "
        f"{peak.stream_pools / gib:.2f} GiB, loss's hole {peak.loss_hole / gib:.2f} GiB, reserved "
        f"{peak.reserved / gib:.2f} GiB",
        "",
        "| allocator | measured allocated | measured reserved | reserved - allocated | "
        "estimated reserved | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for expandable in (False, True):
        got = measure(expandable, gpus)
        lines.append(
            f"| {'expandable segments' if expandable else 'default'} | "
            f"{got['allocated'] / gib:.2f} GiB | {got['reserved'] / gib:.2f} GiB | "
            f"{(got['reserved'] - got['allocated']) / gib:.2f} GiB | {peak.reserved / gib:.2f} GiB "
            f"| {peak.reserved / got['reserved'] - 1:+.1%} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_results(
            args.write,
            "# Reserved memory: measured against the estimate\n\n"
            f"`python benchmarks/reserved_memory_measured.py --write {args.write}`\n\n{text}\n",
        )


if __name__ == "__main__":
    main()
