"""The shared H200 run's 1B memory rows against today's estimate, planned as a CUDA GPU runs them.

    python benchmarks/h200_memory_rows.py [--write benchmarks/results/h200_memory_rows.md]

Reads ``../shared/gpu-runs/2026-11-28-h200/probe_1b_{fresh,shared}_group.json`` (examples/gpt.py
size=1b, 2,048 tokens, one H200, torch 2.11) and estimates each measured candidate again
(``estimate_memory`` without its allowance, the activation profile taken for a CUDA GPU as
``make_plan`` takes it: :func:`autoshard.predict.attention_kernels.attention_device`).

The fresh-group rows are clean. In the shared group every trial after the first carries what
earlier trials left (issue 32); that leftover is read off the FSDP2 bf16-mixed rows, whose
estimate this profile does not change (fused attention), as measured minus estimate, and the
FSDP2 32-true rows are shown with it taken off: a check, not a fit. A 32-true row whose measured
bytes equal the bf16 rows' to the byte peaked at the optimizer step, with the leftover: it only
bounds its activations from above.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT.parent / "shared" / "gpu-runs" / "2026-11-28-h200"
GIB = 2**30


def _estimates(labels: set[str]) -> dict[str, tuple[int, str, bool, int, int]]:
    """label -> (allocated peak without the allowance, its moment, math attention, ``gpu_peak``
    with the allowance, the reserved peak) for the probe's candidates of those labels."""
    from autoshard.analyze import analyze_target
    from autoshard.config import Engine, Hardware, Precision, WorkloadSpec
    from autoshard.gpus import CATALOGUE
    from autoshard.predict.activations import precisions_of, profile_activations
    from autoshard.predict.analytic import estimate_memory, estimate_reserved
    from autoshard.predict.attention_kernels import attention_device
    from autoshard.space import Knobs, enumerate_candidates
    from autoshard.target.resolve import TargetSpec

    target = TargetSpec(spec=f"{ROOT}/examples/gpt.py:build", kwargs={"size": "1b"})
    hardware = Hardware(gpus_per_node=1, gpu_memory=CATALOGUE["h200"].memory, gpu="h200")
    workload = WorkloadSpec(seq_len=2048)
    profile, built = analyze_target(target)
    candidates = [
        c
        for engine in (Engine.FSDP1, Engine.FSDP2)
        for c in enumerate_candidates(
            profile, hardware, workload, Knobs(engine=engine,
            precisions=(Precision.BF16_MIXED, Precision.FP32), micro_batch_sizes=(1,),
            offload=None),
        )
        if not c.compile and c.label() in labels
    ]  # fmt: skip
    acts = profile_activations(
        built.model, profile, workload, precisions=precisions_of(candidates),
        attention_on=attention_device(hardware),
    )  # fmt: skip
    out = {}
    for c in candidates:
        est = estimate_memory(profile, c, hardware, workload, activations=acts)
        peak = est.gpu_peak - est.breakdown.allowance
        reserved = estimate_reserved(profile, c, hardware, workload, activations=acts).reserved
        math = acts.at(c.precision).math_attention
        out[c.label()] = (peak, est.peak_at, math, est.gpu_peak, reserved)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    fresh = json.loads((RUN / "probe_1b_fresh_group.json").read_text())["rows"]
    shared = json.loads((RUN / "probe_1b_shared_group.json").read_text())["rows"]
    estimates = _estimates({r["label"] for r in fresh + shared})
    lines = [
        "# The shared H200 run's 1B memory rows, estimated for a CUDA GPU",
        "",
        f"`python benchmarks/h200_memory_rows.py --write {args.write}`",
        "",
        "## A fresh worker group per trial (clean)",
        "",
        "`gpu_peak` is what a plan holds against the GPU's memory (the allocated peak and its",
        "allowance): a candidate that fits by it must not run out of memory, so it must be at",
        "least the measured allocated peak. The reserved peak is informational (the caching",
        "allocator frees its cache and retries before it raises an out-of-memory error).",
        "",
        "| candidate | measured | estimate | error | moment | math attention | `gpu_peak` "
        "| covers measured? | reserved: measured | estimated |",
        "| --- | ---: | ---: | ---: | --- | --- | ---: | --- | ---: | ---: |",
    ]
    for r in fresh:
        peak, at, math, gpu_peak, reserved = estimates[r["label"]]
        measured = max(r["alloc"])
        lines.append(
            f"| {r['label']} | {measured / GIB:.2f} GiB | {peak / GIB:.2f} GiB | "
            f"{peak / measured - 1:+.1%} | {at} | {'yes' if math else 'no'} | "
            f"{gpu_peak / GIB:.2f} GiB | {'yes' if gpu_peak >= measured else 'NO'} | "
            f"{max(r['reserved']) / GIB:.2f} GiB | {reserved / GIB:.2f} GiB |"
        )
    # the leftover of earlier trials, read off the FSDP2 bf16-mixed rows (fused attention)
    left = [
        max(r["alloc"]) - estimates[r["label"]][0]
        for r in shared
        if r["label"].startswith("fsdp2") and "bf16-mixed" in r["label"]
    ]
    leftover = statistics.median(left)
    lines += [
        "",
        "## One worker group for all (leftover taken off)",
        "",
        f"Leftover of earlier trials: median {leftover / GIB:.3f} GiB over the {len(left)} FSDP2 "
        f"bf16-mixed rows (spread {(max(left) - min(left)) / 2**20:.1f} MiB).",
        "",
        "| candidate | measured | less leftover | estimate | error | moment |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in shared:
        if not r["label"].startswith("fsdp2"):
            continue
        peak, at, *_ = estimates[r["label"]]
        measured = max(r["alloc"])
        clean = measured - leftover
        lines.append(
            f"| {r['label']} | {measured / GIB:.2f} GiB | {clean / GIB:.2f} GiB | "
            f"{peak / GIB:.2f} GiB | {peak / clean - 1:+.1%} | {at} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        args.write.write_text(text)


if __name__ == "__main__":
    main()
