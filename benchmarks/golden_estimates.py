"""Golden file of the estimators: every analytic peak moment and every predicted speed breakdown
of a grid of candidates, written as JSON, so that a refactor of ``autoshard.predict`` can show
that no number moved.

    python benchmarks/golden_estimates.py --write /tmp/golden.json    # before the change
    python benchmarks/golden_estimates.py --check /tmp/golden.json    # after: lists what moved

The grid: FSDP1 and FSDP2; every sharding, checkpointing none / every 2nd / every block, CPU
offload, every precision, micro-batch 1 and 4, every FSDP2 reshard policy (the candidates
:func:`autoshard.space.enumerate_candidates` makes), the whole model as one unit, optimizer
variants (SGD, fused, foreach) and FSDP1's backward prefetch; both loops (lightning, plain),
accumulation 1 and 4; 1 to 512 ranks; gloo and nccl; four model shapes, two with frozen
parameters, one computing its loss in forward (a Hugging Face model given labels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from golden import run_golden  # benchmarks/, the script's own folder

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "gpt-tiny": (f"{ROOT}/examples/gpt.py:build", {"size": "tiny"}),
    "gpt-frozen": (
        f"{ROOT}/examples/gpt.py:build",
        {"size": "tiny", "n_layer": 6, "freeze": "tok_emb,blocks.0,blocks.1"},
    ),
    "gpt-wide": (
        f"{ROOT}/examples/gpt.py:build",
        {"size": "tiny", "n_layer": 2, "d_model": 256, "vocab_size": 16384},
    ),
    "llama-lora": (f"{ROOT}/examples/hf_llama_lora.py:build", {"size": "tiny"}),
}
# (gpus per node, nodes)
WORLDS = [(1, 1), (2, 1), (8, 1), (8, 8), (8, 64)]
SEQ_LEN = 32


def _variants(candidates: list[Any]) -> list[Any]:
    """The enumerated candidates and, for a few of them, the knobs enumeration leaves alone."""
    from autoshard.config import BackwardPrefetch, Optimizer, OptimizerImpl

    extra = []
    for c in candidates[:: max(1, len(candidates) // 12)]:
        extra.append(c.model_copy(update={"optimizer": Optimizer.SGD}))
        extra.append(c.model_copy(update={"optimizer_impl": OptimizerImpl.FUSED}))
        extra.append(c.model_copy(update={"optimizer_impl": OptimizerImpl.FOREACH}))
        if c.engine.value == "fsdp1":
            extra.append(c.model_copy(update={"backward_prefetch": BackwardPrefetch.BACKWARD_POST}))
        else:
            extra.append(c.model_copy(update={"reduce_dtype_fp32": not c.reduce_dtype_fp32}))
    return candidates + extra


def collect() -> dict[str, Any]:
    from autoshard.analyze import analyze_target
    from autoshard.config import Engine, Hardware, Loop, WorkloadSpec
    from autoshard.gpus import CATALOGUE
    from autoshard.predict.activations import profile_activations
    from autoshard.predict.analytic import estimate_memory, peak_moments
    from autoshard.predict.attention_kernels import attention_device
    from autoshard.predict.flops import profile_flops
    from autoshard.predict.speed import SpeedFactors, predict_speed
    from autoshard.space import Knobs, enumerate_candidates
    from autoshard.target.resolve import TargetSpec

    out: dict[str, Any] = {}
    h100 = CATALOGUE["h100-sxm"]
    # fixed CPU rates: the measured ones vary from run to run
    cpu = CATALOGUE["cpu-gloo"].model_copy(update={"fresh_page_bandwidth": 3e9})
    cpu_factors = SpeedFactors(memory_efficiency=0.25, collective_latency_s=8e-4, overlap=0.0)
    for model, (spec, kwargs) in MODELS.items():
        profile, built = analyze_target(TargetSpec(spec=spec, kwargs=kwargs))
        base = WorkloadSpec(seq_len=SEQ_LEN)
        # attention as the planned device runs it (nccl: a CUDA GPU's kernels; gloo: the CPU's)
        acts_on = {
            on: profile_activations(built.model, profile, base, batch=built.batch, attention_on=on)
            for on in ("cuda", "cpu")
        }
        flops = profile_flops(built.model, profile, base, batch=built.batch)
        for gpn, nodes in WORLDS:
            for backend in ("nccl", "gloo"):
                hardware = Hardware(
                    gpus_per_node=gpn, nodes=nodes, gpu_memory=80 * 2**30, backend=backend
                )
                acts = acts_on[attention_device(hardware)]
                cands = []
                for engine in (Engine.FSDP1, Engine.FSDP2):
                    cands += enumerate_candidates(
                        profile,
                        hardware,
                        base,
                        Knobs(engine=engine, micro_batch_sizes=(1, 4), offload=True),
                    )
                cands = _variants(cands)
                for loop in (Loop.LIGHTNING, Loop.PLAIN):
                    for accumulate in (1, 4):
                        workload = WorkloadSpec(seq_len=SEQ_LEN, loop=loop, accumulate=accumulate)
                        for c in cands:
                            key = f"{model}|{gpn}x{nodes}|{backend}|{loop.value}|{accumulate}|" + (
                                c.model_dump_json()
                            )
                            moments, host = peak_moments(profile, c, hardware, workload, acts)
                            est = estimate_memory(profile, c, hardware, workload, activations=acts)
                            gpu, factors = (cpu, cpu_factors) if backend == "gloo" else (h100, None)
                            speed = predict_speed(
                                profile, flops, c, hardware, workload, factors, gpu=gpu
                            )
                            out[key] = {
                                "moments": {n: m.model_dump() for n, m in moments.items()},
                                "host": host,
                                "peak_at": est.peak_at,
                                "gpu_peak": est.gpu_peak,
                                "speed": speed.model_dump(),
                            }
    return out


def _show_moved(key: str, before: dict[str, Any], after: dict[str, Any] | None) -> None:
    after = after or {}
    print("MOVED", key[:160])
    for part in ("moments", "speed"):
        was, now = before.get(part, {}), after.get(part, {})
        for name in sorted(was.keys() | now.keys()):
            if was.get(name) != now.get(name):
                print(f"   {part} {name}: {was.get(name)} -> {now.get(name)}")
    for part in ("host", "peak_at", "gpu_peak"):
        if before.get(part) != after.get(part):
            print(f"   {part}: {before.get(part)} -> {after.get(part)}")


if __name__ == "__main__":
    run_golden(
        __doc__, collect, what=lambda got: f"{len(got)} candidate x workload rows",
        show_moved=_show_moved,
    )  # fmt: skip
