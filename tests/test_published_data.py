"""benchmarks/data/published_fsdp.json: complete, internally consistent, transcribed right;
and the benchmark's split of it into a fitting and a held-out set, fixed and stable.

The MFU check recomputes each published MFU from the record's own model, throughput and the
catalogue's peak: a digit typed wrong in a throughput, a parameter count or a GPU id shows up as
an MFU that no longer matches the source's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from autoshard.config import Candidate, Optimizer, Sharding
from autoshard.gpus import CATALOGUE

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
DATA = BENCHMARKS / "data" / "published_fsdp.json"
EFFECTS = BENCHMARKS / "data" / "published_compile_float8.json"
GROUPS: list[dict[str, Any]] = json.loads(DATA.read_text())["groups"]
RECORDS = [(group, record) for group in GROUPS for record in group["records"]]
IDS = [record["id"] for _, record in RECORDS]
MODEL_KEYS = {
    "name", "family", "params", "params_source", "layers", "hidden", "heads", "kv_heads",
    "ffn_hidden", "ffn", "vocab", "tied_embeddings", "learned_pos_emb", "seq_len",
}  # fmt: skip


def _benchmark() -> ModuleType:
    """benchmarks/step_time_published.py as a module (it imports results_file beside it)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(
            "step_time_published", BENCHMARKS / "step_time_published.py"
        )
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


BENCHMARK = _benchmark()
SOURCES = sorted({group["source"] for group in GROUPS})


def test_sources_are_cited_and_grouped() -> None:
    assert len(IDS) == len(set(IDS)), "record ids must be unique"
    assert len({group["id"] for group in GROUPS}) == len(GROUPS)
    for group in GROUPS:
        assert group["source"], "every group names the document it comes from"
        assert group["url"].startswith("https://") and group["title"] and group["where"]
        assert group["order"] and group["varies"] and group["records"]
        assert group["complete"] or group["missing"]
    complete = [r for g, r in RECORDS if g["complete"]]
    assert len(complete) >= 4 and len([g for g in GROUPS if g["complete"]]) >= 4


@pytest.mark.parametrize(("group", "record"), RECORDS, ids=IDS)
def test_record_is_complete_and_consistent(group: dict[str, Any], record: dict[str, Any]) -> None:
    # "projections": "separate" where the source's model is torchtitan's (wq/wk/wv, w1/w3)
    assert MODEL_KEYS <= set(record["model"]) <= MODEL_KEYS | {"projections"}
    assert record["model"].get("projections", "separate") == "separate"
    assert record["gpu"] in CATALOGUE and record["gpu"] != "cpu-gloo"
    assert record["sharding"] in {s.value for s in Sharding}
    assert record["global_batch_size"] == (
        record["micro_batch_size"] * record["grad_accum"] * record["gpus"]
    )
    assert record["nodes"] * record["gpus_per_node"] == record["gpus"]
    assert record["throughput"]["tokens_per_s_per_gpu"] > 0
    assert record["activation_checkpointing"] and record["precision"] and record["engine"]
    assert isinstance(record["compile"], bool) and isinstance(record["cpu_offload"], bool)
    assert record["float8"] is None or record["float8"]
    assert record["optimizer"] in {o.value for o in Optimizer}
    if record["memory"] is not None:  # published memory: a value, a unit, what it measures
        assert record["memory"]["value"] > 0 and record["memory"]["what"]
        assert record["memory"]["unit"] in {"GiB", "GB", "MB", "MiB"}
        # which allocator statistic: the comparison holds it against the same estimate
        assert record["memory"]["measures"] in {"reserved", "allocated", "active", None}
        assert record["memory"]["expandable_segments"] in {True, False, None}
    # FSDP1's backward prefetch decides whether backward all-gathers hide; FSDP2 (and one GPU
    # without an FSDP wrapper) has no setting
    if record["engine"].startswith(("fsdp2", "none")):
        assert record["backward_prefetch"] is None
    else:
        assert record["backward_prefetch"] in {"BACKWARD_PRE", "BACKWARD_POST", "NONE"}
        assert any(line.startswith("backward_prefetch:") for line in record["inferred"])
    # with accumulation, the micro-batches before the last reduce their gradients or not
    assert record["gradient_sync"] in {"every_micro_batch", "last_micro_batch", None}
    if record["grad_accum"] > 1:
        assert record["gradient_sync"] is not None
        assert any(line.startswith("gradient_sync:") for line in record["inferred"])
    if group["complete"]:  # the links a step-time model needs are known
        assert record["intra_node"]["bandwidth"] > 0
        assert (record["inter_node"] is None) == (record["nodes"] == 1)
    if record["sharding"] == "HYBRID_SHARD":
        assert record["nodes"] > 1, "HSDP on one node is FULL_SHARD"
    if record["engine"].startswith("none"):
        assert record["gpus"] == 1, "only a one-GPU run may have no FSDP wrapper"


@pytest.mark.parametrize(("group", "record"), RECORDS, ids=IDS)
def test_every_record_is_plannable_or_says_why_not(
    group: dict[str, Any], record: dict[str, Any]
) -> None:
    """The benchmark plans a record, or names what the candidate space lacks for it: nothing
    is dropped silently. A plannable record's fields make a valid Candidate."""
    why = BENCHMARK.unplannable(record)
    assert set(why) <= {"float8 rowwise", "float8 not torchao/FSDP2"}
    # torch.compile and torchao's tensorwise float8 on FSDP2 are planned (issue 24)
    float8 = record["float8"] or ""
    other_float8 = "rowwise" in float8 or not record["engine"].startswith("fsdp2")
    assert any(w.startswith("float8") for w in why) == bool(float8 and other_float8)
    # torchtitan's per-op selective checkpointing is planned as such (issue 23), not approximated
    fields, note = BENCHMARK.checkpointing(record, ("m.Block",))
    if BENCHMARK.is_selective_op(record["activation_checkpointing"]):
        assert fields["checkpointing"] == "selective" and not note
    if not why:
        hybrid = record["sharding"] == "HYBRID_SHARD"
        Candidate(
            engine="fsdp2" if record["engine"].startswith(("fsdp2", "none")) else "fsdp1",
            precision=BENCHMARK.precision_of(record),
            compile=record["compile"],
            float8=bool(float8),
            sharding=record["sharding"],
            hybrid_mesh=(record["nodes"], record["gpus_per_node"]) if hybrid else None,
            cpu_offload=record["cpu_offload"],
            optimizer=record["optimizer"],
            micro_batch_size=record["micro_batch_size"],
        )


def test_the_split_is_fixed_by_the_source_id() -> None:
    """Same id, same set, whatever else changes; the documents the model was built on are
    fitting; any other falls by sha256(id) mod 3 (values computed by hand below)."""
    split = BENCHMARK.split
    for source in BENCHMARK.BUILT_ON:
        assert split(source) == "fitting"
    # sha256 mod 3 of these ids: 0, 0, 1, 2 (hashlib, computed once and written here)
    assert split("lightning-docs-fsdp-trainer-guide") == "held-out"
    assert split("kempnerforge-mfu-scaling-report") == "held-out"
    assert split("lightning-docs-fsdp-fabric-guide") == "fitting"
    assert split("torchtitan-benchmarks-trainy-h200-202506") == "fitting"
    # the second pass's documents (issue 24): held out by the same rule, ids pinned here so
    # that renaming a source cannot move it between the sets unnoticed
    held_out = {
        "litgpt-thunder-extension-readme",
        "torchtitan-pr-165-per-parameter-fsdp",
        "dlrover-atorch-llama2-readme",
        "torchtune-readme",
        # the third pass's (issue 24): named after the title before it was scored
        "litgpt-issue-864-multi-gpu-pretraining-slower",
    }
    fitting = {
        "torchao-float8-readme",
        "lightning-thunder-pr-940-fsdp2-benchmark",
        "lightning-thunder-pr-1528-float8-fsdp2",
        "yafsdp-readme-benchmarks",
        "pytorch-blog-ibm-fsdp-compile",
        "colossalai-lightning-gpt-benchmark",
    }
    assert {split(s) for s in held_out} == {"held-out"} and {split(s) for s in fitting} == {
        "fitting"
    }
    first_pass = {
        "lightning-docs-fsdp-trainer-guide",
        "kempnerforge-mfu-scaling-report",
        "lightning-docs-fsdp-fabric-guide",
        "torchtitan-benchmarks-trainy-h200-202506",
    }
    # every document of the data is one of the ids pinned here
    assert set(SOURCES) == BENCHMARK.BUILT_ON | first_pass | held_out | fitting
    assert [split(s) for s in SOURCES] == [split(s) for s in SOURCES]  # no state, no order


def test_a_document_the_model_was_built_on_stays_fitting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Used is used: a built-on document whose hash would hold it out is still fitting."""
    assert BENCHMARK.split("lightning-docs-fsdp-trainer-guide") == "held-out"
    monkeypatch.setattr(BENCHMARK, "BUILT_ON", frozenset({"lightning-docs-fsdp-trainer-guide"}))
    assert BENCHMARK.split("lightning-docs-fsdp-trainer-guide") == "fitting"


def test_no_source_in_both_sets_and_both_sets_plannable() -> None:
    sets_of: dict[str, set[str]] = {}
    for group in GROUPS:
        sets_of.setdefault(group["source"], set()).add(BENCHMARK.split(group["source"]))
    assert all(len(sets) == 1 for sets in sets_of.values())
    # every group of a document shares its set: the split is by document, not by group
    plannable = {
        name: [r for g, r in RECORDS if BENCHMARK.split(g["source"]) == name
               and not BENCHMARK.unplannable(r)]
        for name in ("fitting", "held-out")
    }  # fmt: skip
    assert plannable["held-out"] and plannable["fitting"]
    # the documents the model was built and checked on are all in the data, and fitting
    assert set(SOURCES) >= BENCHMARK.BUILT_ON


def test_effect_sizes_are_cited_and_their_ratios_computed_right() -> None:
    effects = json.loads(EFFECTS.read_text())["effects"]
    assert {e["id"] for e in effects} >= {"torchtitan-h100-llama3.1-8b-g8"}
    for effect in effects:
        assert effect["url"].startswith("https://") and effect["where"]
        for kind in ("compile", "float8"):
            for pair in _pairs(effect.get(kind)):
                assert pair["ratio"] == pytest.approx(pair["with"] / pair["baseline"], abs=1e-4)
    # the torchtitan table, as published: 5762 -> 6667 -> 8532 tokens/s/GPU on 8 H100
    tt = next(e for e in effects if e["id"] == "torchtitan-h100-llama3.1-8b-g8")
    assert (tt["compile"]["speed"]["baseline"], tt["compile"]["speed"]["with"]) == (5762, 6667)
    assert tt["float8"]["speed"]["with"] == 8532


def _pairs(effect: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not effect:
        return []
    found = [v for v in effect.values() if isinstance(v, dict) and "baseline" in v]
    for value in effect.values():
        if isinstance(value, list):
            found += [v for v in value if "baseline" in v]
    return found


@pytest.mark.parametrize(
    ("group", "record"),
    [(g, r) for g, r in RECORDS if "mfu" in r["throughput"]],
    ids=[r["id"] for _, r in RECORDS if "mfu" in r["throughput"]],
)
def test_published_mfu_matches_the_record(group: dict[str, Any], record: dict[str, Any]) -> None:
    model = record["model"]
    # 6 FLOPs per parameter per token (forward + backward) plus attention's 12·L·H·S per token:
    # the formula llm-foundry, torchtitan and the PaLM/nanoGPT MFU of the IBM blog all use.
    # llm-foundry and torchtitan match it to 0.3%, so 1% catches a transposed digit; the IBM
    # blog's two-digit MFU for 34B/70B is 6-8% below it (its FLOP count for these GQA models
    # differs), so its records get 10%.
    flops_per_token = (
        6 * model["params"] + 12 * model["layers"] * model["hidden"] * (model["seq_len"])
    )
    peak = CATALOGUE[record["gpu"]].bf16_flops
    mfu = flops_per_token * record["throughput"]["tokens_per_s_per_gpu"] / peak
    tolerance = 0.10 if group["id"].startswith("pytorch-blog-ibm") else 0.01
    assert mfu == pytest.approx(record["throughput"]["mfu"], rel=tolerance)


@pytest.mark.parametrize(
    ("name", "params"),
    [  # Hugging Face parameter counts of the released checkpoints
        ("Llama 2 7B", 6_738_415_616),
        ("Llama 2 13B", 13_015_864_320),
        ("Llama 2 70B", 68_976_648_192),
        ("Llama 3.1 8B", 8_030_261_248),
    ],
)
def test_llama_parameter_counts_match_the_released_models(name: str, params: int) -> None:
    counts = {r["model"]["params"] for _, r in RECORDS if r["model"]["name"].startswith(name)}
    assert counts == {params}


@pytest.mark.parametrize(
    ("group", "record"),
    [(g, r) for g, r in RECORDS if set(r["throughput"]) - {"tokens_per_s_per_gpu", "mfu", "hfu"}],
    ids=[
        r["id"] for _, r in RECORDS if set(r["throughput"]) - {"tokens_per_s_per_gpu", "mfu", "hfu"}
    ],
)
def test_derived_throughput_follows_from_what_was_published(
    group: dict[str, Any], record: dict[str, Any]
) -> None:
    """Where the source printed a time, a range, a total or a TFLOP/s instead of tokens/s per
    GPU, the record keeps the printed value and the derived rate must follow from it: a digit
    typed wrong in either shows up here."""
    published = record["throughput"]
    tokens = published["tokens_per_s_per_gpu"]
    per_step = record["micro_batch_size"] * record["model"]["seq_len"]
    if "ms_per_iter" in published:  # litgpt: one logged iteration is one micro-batch
        assert tokens == pytest.approx(per_step / (published["ms_per_iter"] / 1e3), rel=1e-4)
    if "iteration_time_s" in published:  # YaFSDP: one micro-batch per iteration
        assert tokens == pytest.approx(per_step / published["iteration_time_s"], rel=1e-3)
    if "wps_range" in published:  # torchtitan PR #165 prints a range: its midpoint
        low, high = published["wps_range"]
        assert low <= tokens <= high and tokens == pytest.approx((low + high) / 2)
    if "tokens_per_s_as_published" in published:  # a total over the job's GPUs
        assert tokens == pytest.approx(published["tokens_per_s_as_published"] / record["gpus"])
    if "samples_per_s_all_gpus" in published:
        total = published["samples_per_s_all_gpus"] * record["model"]["seq_len"]
        assert tokens == pytest.approx(total / record["gpus"], rel=1e-4)
    if "tflops_per_gpu" in published:  # DLRover: its own Megatron-style count, recompute in
        model = record["model"]
        h, s, i, v = model["hidden"], model["seq_len"], model["ffn_hidden"], model["vocab"]
        layer = 8 * s * h**2 + 4 * s**2 * h + 6 * s * h * i
        per_token = (model["layers"] * layer * 4 + 2 * s * h * v * 3) / s
        assert tokens == pytest.approx(published["tflops_per_gpu"] * 1e12 / per_token, rel=1e-4)
        assert published["hfu"] == pytest.approx(published["tflops_per_gpu"] / 312, abs=1e-3)


def test_partial_checkpointing_and_precisions_are_read_as_published() -> None:
    """'first N of L blocks' (YaFSDP's num-ckpt-layers) becomes every round(L/N)-th block, with
    a note; bf16-true and fp16 sources are planned in their own precision, not bf16-mixed."""
    blocks = ("Block",)
    ckpt, note = BENCHMARK.checkpointing(
        {"activation_checkpointing": "first 10 of 80 blocks"}, blocks
    )
    assert (ckpt["checkpointing"], ckpt["checkpoint_every"]) == ("every_k", 8)
    assert "10 blocks" in note
    ckpt, note = BENCHMARK.checkpointing(
        {"activation_checkpointing": "first 5 of 48 blocks"}, blocks
    )
    assert ckpt["checkpoint_every"] == 10 and "5 blocks" in note
    for record in (r for _, r in RECORDS if r["activation_checkpointing"].startswith("first ")):
        count, of = (int(w) for w in record["activation_checkpointing"].split()[1::2][:2])
        assert 0 < count <= of == record["model"]["layers"]
    assert BENCHMARK.precision_of({"precision": "bf16-true (Fabric)"}) == "bf16-true"
    assert BENCHMARK.precision_of({"precision": "16-mixed (DeepSpeed fp16)"}) == "16-mixed"
    assert BENCHMARK.precision_of({"precision": "32-true (fp32)"}) == "32-true"
    assert BENCHMARK.precision_of({"precision": "bf16 autocast; FSDP"}) == "bf16-mixed"


def test_torchtitans_memory_column_is_predicted_as_the_reserved_peak_it_is() -> None:
    """torchtitan logs max_memory_reserved: its 8B row (8 H100, FSDP2, op-level selective
    checkpointing) is held against the predicted reserved peak, built with torchtitan's
    wq/wk/wv, w1/w3 layout, within issue 24's 10% (it was -28% against the planner's gpu_peak
    on the fused layout: the every-other-matmul policy then saves 12,288 instead of 23,552
    elements per token and block)."""
    record = next(
        r
        for g, r in RECORDS
        if g["id"] == "torchtitan-h100-llama3.1-8b-gpu-count"
        and r["gpus"] == 8
        and not r["compile"]
    )
    row = {"record": record, **BENCHMARK.predict(record, {})}
    estimated, what = BENCHMARK.comparable_estimate(row)
    published = BENCHMARK.published_bytes(record["memory"])
    assert what == "reserved" and abs(estimated / published - 1) <= 0.10
    # the same row on the fused layout saves 11 GiB less and misses by far more than 10%
    fused = {**record, "model": {**record["model"], "projections": "fused"}}
    fused_row = {"record": fused, **BENCHMARK.predict(fused, {})}
    assert estimated - BENCHMARK.comparable_estimate(fused_row)[0] > 10 * 2**30
    # an allocated number is held against the allocated peak, without the allocator's reserve
    allocated = {**record, "memory": {**record["memory"], "measures": "allocated"}}
    assert BENCHMARK.comparable_estimate({**row, "record": allocated}) == (
        row["reserved"].allocated,
        "allocated",
    )
