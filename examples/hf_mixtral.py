"""A Mixtral (mixture-of-experts) model from a Hugging Face ``MixtralConfig``: no weights are
downloaded.

    autoshard estimate examples/hf_mixtral.py:build --arg size=8x7b --arg seq_len=4096 \\
        --arg batch_size=1 --gpus 8 --nodes 2 --gpu-memory 80GiB

    import autoshard
    rec = autoshard.recommend(
        "examples/hf_mixtral.py:build", kwargs={"size": "8x7b", "seq_len": 4096, "batch_size": 1},
        gpus=8, nodes=2, gpu_memory="80GiB")

Block class: ``MixtralDecoderLayer`` (the model's ``_no_split_modules``); each block's feed-forward
is ``num_local_experts`` experts, of which a router picks ``num_experts_per_tok`` per token.
Every expert's weights are parameters of the block (all are gathered and sharded with it); the
activations depend on the routing: autoshard plans for balanced routing (each expert gets
tokens x top_k / experts on average), which is what transformers' default ``grouped_mm`` experts
kernel computes for any routing, in one (tokens x top_k)-row matrix. The example batch is a dict
with ``labels``, so the model returns its own causal-LM ``.loss``. Needs ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import MixtralConfig, MixtralForCausalLM

SIZES: dict[str, dict[str, Any]] = {
    # about a million parameters, 4 experts of which 2 per token: trials on a CPU in seconds
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
        num_local_experts=4, num_experts_per_tok=2,
    ),
    # Mixtral 8x7B: 46.7B parameters, 8 experts of which 2 per token
    "8x7b": dict(
        hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768,
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6,
    ),
}  # fmt: skip


def config(size: str = "tiny", **overrides: Any) -> MixtralConfig:
    """The ``MixtralConfig`` of a named size, with any field overridden."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    return MixtralConfig(**{**SIZES[size], **overrides})


def build(
    size: str = "tiny", batch_size: int = 2, seq_len: int = 32, **overrides: Any
) -> tuple[MixtralForCausalLM, dict[str, torch.Tensor]]:
    """``MixtralForCausalLM`` of ``size`` and a causal-LM batch (``input_ids`` and ``labels``)."""
    cfg = config(size, **overrides)
    model = MixtralForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device="cpu")
    return model, {"input_ids": ids, "labels": ids}
