"""benchmarks/data/published_fsdp.json: complete, internally consistent, transcribed right.

The MFU check recomputes each published MFU from the record's own model, throughput and the
catalogue's peak: a digit typed wrong in a throughput, a parameter count or a GPU id shows up as
an MFU that no longer matches the source's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autoshard.config import Sharding
from autoshard.gpus import CATALOGUE

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "published_fsdp.json"
GROUPS: list[dict[str, Any]] = json.loads(DATA.read_text())["groups"]
RECORDS = [(group, record) for group in GROUPS for record in group["records"]]
IDS = [record["id"] for _, record in RECORDS]
MODEL_KEYS = {
    "name", "family", "params", "params_source", "layers", "hidden", "heads", "kv_heads",
    "ffn_hidden", "ffn", "vocab", "tied_embeddings", "learned_pos_emb", "seq_len",
}  # fmt: skip


def test_sources_are_cited_and_grouped() -> None:
    assert len(IDS) == len(set(IDS)), "record ids must be unique"
    assert len({group["id"] for group in GROUPS}) == len(GROUPS)
    for group in GROUPS:
        assert group["url"].startswith("https://") and group["title"] and group["where"]
        assert group["order"] and group["varies"] and group["records"]
        assert group["complete"] or group["missing"]
    complete = [r for g, r in RECORDS if g["complete"]]
    assert len(complete) >= 4 and len([g for g in GROUPS if g["complete"]]) >= 4


@pytest.mark.parametrize(("group", "record"), RECORDS, ids=IDS)
def test_record_is_complete_and_consistent(group: dict[str, Any], record: dict[str, Any]) -> None:
    assert set(record["model"]) == MODEL_KEYS
    assert record["gpu"] in CATALOGUE and record["gpu"] != "cpu-gloo"
    assert record["sharding"] in {s.value for s in Sharding}
    assert record["global_batch_size"] == (
        record["micro_batch_size"] * record["grad_accum"] * record["gpus"]
    )
    assert record["nodes"] * record["gpus_per_node"] == record["gpus"]
    assert record["throughput"]["tokens_per_s_per_gpu"] > 0
    assert record["activation_checkpointing"] and record["precision"] and record["engine"]
    # FSDP1's backward prefetch decides whether backward all-gathers hide; FSDP2 has no setting
    if record["engine"].startswith("fsdp2"):
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
