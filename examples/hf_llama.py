"""A Llama-architecture model from a Hugging Face ``LlamaConfig``: no weights are downloaded.

    autoshard estimate examples/hf_llama.py:build --arg size=8b --arg seq_len=4096 --gpus 8 \
        --gpu-memory 80GiB

    import autoshard
    rec = autoshard.recommend("examples/hf_llama.py:build", kwargs={"size": "8b", "seq_len": 4096},
                              gpus=8, gpu_memory="80GiB")

Block class: ``LlamaDecoderLayer``, named by the model's ``_no_split_modules``. The example batch
is a dict with ``labels``, so the model returns its own causal-LM ``.loss``.
Needs ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SIZES: dict[str, dict[str, Any]] = {
    # a few hundred thousand parameters: trials on a CPU in seconds
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
    ),
    # Llama 3 8B: 8.03B parameters
    "8b": dict(
        hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    # Llama 3 70B
    "70b": dict(
        hidden_size=8192, num_hidden_layers=80, intermediate_size=28672, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
}  # fmt: skip


def config(size: str = "tiny", **overrides: Any) -> LlamaConfig:
    """The ``LlamaConfig`` of a named size, with any field overridden."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    return LlamaConfig(**{**SIZES[size], **overrides})


def build(
    size: str = "tiny", batch_size: int = 2, seq_len: int = 32, **overrides: Any
) -> tuple[LlamaForCausalLM, dict[str, torch.Tensor]]:
    """``LlamaForCausalLM`` of ``size`` and a causal-LM batch (``input_ids`` and ``labels``)."""
    cfg = config(size, **overrides)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device="cpu")
    return model, {"input_ids": ids, "labels": ids}
