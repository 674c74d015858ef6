"""Golden file of the emitters: every text format (``autoshard.emit.render``), the Hugging Face
Trainer's notes, the Lightning strategy and Trainer arguments and the handover notices of a grid
of decisions, written as JSON, so that a refactor of ``autoshard.emit`` can show that no output
moved.

    python benchmarks/golden_emitted.py --write /tmp/emitted.json    # before the change
    python benchmarks/golden_emitted.py --check /tmp/emitted.json    # after: lists what moved

The grid: FSDP1 and FSDP2; every sharding (HYBRID_SHARD on 2 x 4 ranks); checkpointing none,
every 2nd block, selective, every block; every precision; CPU offload; FSDP2's reshard
policies; torch.compile; float8; wrapped by class, by size or one unit; FSDP1's backward
prefetch and all-gather limit; a gradient-accumulating workload; a Hugging Face model (its
key/value cache note) and a model too large for a full state dict; chosen by trials or by
estimate. A format that cannot express a decision records its one-line error. Only the outputs
the ``--write`` run recorded are compared: a format added later is new, not moved.
"""

from __future__ import annotations

import itertools
import re
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from golden import run_golden  # benchmarks/, the script's own folder

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
WHEN = datetime(2026, 11, 22, 12, 46, tzinfo=timezone.utc)


def _profiles() -> dict[str, Any]:
    from autoshard.results import ClassStat, ModelProfile

    gpt = ModelProfile(
        target="examples/gpt.py:build size='tiny'", model_class="gpt.GPT",
        total_params=1_872_640, trainable_params=1_872_640, param_bytes=7_490_560,
        block_classes=("gpt.Block",), block_count=4, block_params=197_760,
        wrap_policy=("gpt.Block",), checkpoint_policy=("gpt.Block",), vocab_size=4096,
    )  # fmt: skip
    hf_class = ClassStat(
        class_path="transformers.models.llama.modeling_llama.LlamaDecoderLayer",
        name="LlamaDecoderLayer", count=4, params_each=197_760, params_total=791_040, share=0.42,
    )  # fmt: skip
    return {
        "gpt": gpt,
        "hf": gpt.model_copy(update={"classes": (hf_class,)}),
        "large": gpt.model_copy(update={"total_params": 8_000_000_000}),
    }


def _candidates() -> list[Any]:
    from autoshard.config import Candidate

    out = []
    grid = itertools.product(
        ("fsdp1", "fsdp2"),
        ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"),
        (("none", 1), ("every_k", 2), ("selective", 1), ("all", 1)),
        ("bf16-mixed", "32-true", "16-mixed", "bf16-true"),
        ("classes", "size", "none"),
    )
    for engine, sharding, (ckpt, every), precision, wrap in grid:
        base: dict[str, Any] = {
            "engine": engine, "sharding": sharding, "precision": precision,
            "checkpointing": ckpt, "checkpoint_every": every, "micro_batch_size": 2,
            "hybrid_mesh": (2, 4) if sharding == "HYBRID_SHARD" else None,
        }  # fmt: skip
        if ckpt != "none":
            base["checkpoint_classes"] = ("gpt.Block",)
        if wrap == "classes":
            base["wrap_classes"] = ("gpt.Block",)
        elif wrap == "size":
            base["min_num_params"] = 100_000
        out.append(Candidate(**base))
        extras: list[dict[str, Any]] = [{"cpu_offload": True}, {"compile": True}]
        if engine == "fsdp1":
            extras += [
                {"backward_prefetch": "BACKWARD_POST"}, {"backward_prefetch": "NONE"},
                {"limit_all_gathers": False, "forward_prefetch": True},
            ]  # fmt: skip
        elif wrap == "classes":
            extras += [{"reshard": "keep_root"}, {"reshard": "keep_root_and_last"}]
            extras += [{"reduce_dtype_fp32": False}]
            if precision in ("bf16-mixed", "bf16-true"):
                extras += [{"float8": True}, {"float8": True, "compile": True}]
        if sharding == "FULL_SHARD" and wrap == "classes" and ckpt == "none":
            extras += [{"optimizer": "sgd"}, {"optimizer_impl": "fused"}]
        for extra in extras:
            out.append(Candidate(**{**base, **extra}))
    return out


def _decision(profile: Any, candidate: Any, basis: str, accumulate: int) -> Any:
    from autoshard.config import Hardware, WorkloadSpec
    from autoshard.recommendation import Recommendation
    from autoshard.results import MemoryBreakdown, MemoryEstimate, Scored, TrialResult

    b = MemoryBreakdown(sharded_params=3_700_000, gradients=3_700_000, optimizer=7_500_000,
                        activations=60_000_000, allowance=900_000_000)  # fmt: skip
    usable = int(80 * GiB * 0.95)
    estimate = MemoryEstimate(
        candidate=candidate, method="analytic", gpu_peak=b.total, breakdown=b, fits=True,
        headroom=usable - b.total,
    )  # fmt: skip
    trial = TrialResult(
        candidate=candidate, status="ok", world_size=8, step_time=0.228,
        step_times=(0.228, 0.23, 0.227), samples_per_s=70.2, tokens_per_s=8980.0,
        peak_allocated=(280_000_000, 270_000_000), peak_reserved=(400_000_000, 390_000_000),
        losses=(8.3, 8.2), started_at=WHEN,
    )  # fmt: skip
    return Recommendation(
        profile=profile,
        hardware=Hardware(gpus_per_node=4, nodes=2, gpu_memory=80 * GiB),
        workload=WorkloadSpec(micro_batch_size=2, seq_len=128, accumulate=accumulate),
        chosen=Scored(
            candidate=candidate, estimate=estimate, trial=trial if basis == "trials" else None
        ),
        basis=basis,
        reasons=("fastest of 4 measured configurations",),
        created_at=WHEN,
        versions={"autoshard": "0.1.0", "torch": "2.13.0"},
    )


def _outputs(rec: Any) -> dict[str, str]:
    """Every output of one decision: each text format's, or the one line of its error."""
    from autoshard import emit
    from autoshard.errors import AutoshardError

    def run(make: Any) -> str:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                text = make()
            except AutoshardError as exc:
                text = f"error {type(exc).__name__}: {exc}"
        notices = [f"{w.category.__name__}: {w.message}" for w in caught]
        # an object's repr names its address, which differs from run to run
        shown = text if isinstance(text, str) else re.sub(r" at 0x[0-9a-f]+", "", repr(text))
        return shown + "".join(f"\n{n}" for n in notices)

    out = {fmt.value: run(lambda fmt=fmt: emit.render(rec, fmt)) for fmt in emit.FORMATS}
    out["hf-notes"] = run(lambda: emit.hf_trainer_config(rec)[1])
    out["trainer_arguments"] = run(lambda: emit.trainer_arguments(rec))
    out["trainer_kwargs"] = run(lambda: emit.trainer_kwargs(rec))
    out["strategy_kwargs"] = run(lambda: emit.strategy_kwargs(rec))
    out["state_dict_type"] = run(lambda: emit.choose_state_dict_type(rec))
    return out


def collect() -> dict[str, str]:
    sys.path.insert(0, str(ROOT / "examples"))  # gpt.Block, as the wrap classes name it
    out: dict[str, str] = {}
    candidates = _candidates()
    for name, profile in _profiles().items():
        for c in candidates:
            for basis, accumulate in (("trials", 1), ("estimate", 4)):
                if name != "gpt" and (basis, c.engine.value) != ("trials", "fsdp2"):
                    continue  # the other profiles change a note or two: one slice of the grid
                rec = _decision(profile, c, basis, accumulate)
                key = f"{name}|{basis}|{accumulate}|{c.model_dump_json()}"
                for what, text in _outputs(rec).items():
                    out[f"{key}|{what}"] = text
    return out


def _show_moved(key: str, before: str, after: str | None) -> None:
    print("MOVED", key[:200])
    print("  before:", before[:600].replace("\n", "\n          "))
    print("  after: ", str(after)[:600].replace("\n", "\n          "))


def _outputs_of(got: dict[str, str]) -> str:
    decisions = len({key.rsplit("|", 1)[0] for key in got})
    return f"{len(got)} outputs of {decisions} decisions"


if __name__ == "__main__":
    run_golden(
        __doc__, collect, what=_outputs_of, show_moved=_show_moved,
        baseline=lambda text: re.sub(r" at 0x[0-9a-f]+", "", text),
    )  # fmt: skip
