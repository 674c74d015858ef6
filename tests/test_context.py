"""A sequence past the model's own context is one line at plan time, at every door (it used to
be estimated as if fine, then fail every trial with ``IndexError: index out of range``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autoshard
from autoshard.analyze import find_context
from autoshard.errors import ConfigError

from .conftest import EXAMPLES

GPT = f"{EXAMPLES}/gpt.py:build"
PLAN = {"gpus": 8, "gpu_memory": "80GiB"}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autoshard.PlanWarning)
        yield


def test_gpt_positional_table_is_the_limit():
    profile, _ = autoshard.analyze_target(autoshard.TargetSpec(spec=GPT, kwargs={"size": "tiny"}))
    assert profile.context_length == 256
    assert "pos_emb" in profile.context_source
    # at the limit: planned as asked
    assert autoshard.estimate(GPT, kwargs={"size": "tiny"}, seq_len=256, **PLAN).plan.workload.seq_len == 256  # fmt: skip


@pytest.mark.parametrize("door", ["estimate", "recommend", "tune"])
def test_past_the_table_every_python_door(door, tmp_path):
    options = {"kwargs": {"size": "tiny"}, "seq_len": 257, **PLAN}
    if door == "tune":
        options.update(trials=1, out_dir=str(tmp_path))  # refused before any worker starts
    with pytest.raises(ConfigError) as raised:
        getattr(autoshard, door)(GPT, **options)
    assert str(raised.value) == (
        "seq_len 257 is past the model's context of 256 tokens (positional table pos_emb "
        "(Embedding(256, 128))): give --seq-len 256 or less (seq_len= in code)"
    )


@pytest.mark.parametrize("command", ["estimate", "tune"])
def test_past_the_table_cli_is_one_line_exit_1(cli, command, tmp_path):
    extra = ["--out", str(tmp_path), "--trials", "1"] if command == "tune" else []
    code, _, err = cli(command, GPT, "--arg", "size=tiny", "--seq-len", "1024", "--gpus", "8",
                         "--gpu-memory", "80GiB", *extra)  # fmt: skip
    assert code == 1
    errors = [line for line in err.splitlines() if not line.startswith("warning:")]
    assert errors == [
        "error: seq_len 1024 is past the model's context of 256 tokens (positional table "
        "pos_emb (Embedding(256, 128))): give --seq-len 256 or less (seq_len= in code)"
    ]
    assert "Traceback" not in err and not list(tmp_path.glob("workers*"))


def test_hf_gpt2_n_positions():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    with pytest.raises(
        ConfigError, match=r"context of 64 tokens \(positional table transformer.wpe"
    ):
        autoshard.recommend(model, seq_len=65, **PLAN)
    # a batch past it is the same mistake, said as the batch's
    batch = {"input_ids": torch.randint(0, 256, (2, 100))}
    with pytest.raises(
        ConfigError, match=r"has 100 tokens per sample, past the model's context of 64"
    ):
        autoshard.recommend(model, batch=batch, **PLAN)
    assert autoshard.recommend(model, seq_len=64, **PLAN).workload.seq_len == 64


def test_hf_llama_max_position_embeddings():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(
        ConfigError, match=r"context of 256 tokens \(config.max_position_embeddings\)"
    ):
        autoshard.estimate(model, seq_len=4096, **PLAN)


class Rotary(nn.Module):
    """A block with a precomputed rotary table of 128 positions (torchtitan's freqs_cis)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.proj = nn.Linear(16, 100)
        self.register_buffer("freqs_cis", torch.zeros(128, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids) + self.freqs_cis[: ids.shape[1], :].repeat(1, 2))


def test_rotary_cache_is_a_limit():
    assert find_context(Rotary()) == (128, "position cache freqs_cis (128, 8)")
    # PyTorch's tutorial keeps its sinusoidal table as (positions, 1, features)
    sinusoidal = nn.Sequential(nn.Embedding(100, 16))
    sinusoidal.register_buffer("pe", torch.zeros(5000, 1, 16))
    assert find_context(sinusoidal) == (5000, "position cache pe (5000, 1, 16)")
    assert find_context(nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8))) is None
