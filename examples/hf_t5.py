"""T5 from a Hugging Face ``T5Config``: an encoder-decoder trained on ``labels``, no download.

    autoshard estimate examples/hf_t5.py:build --arg size=t5-large --gpus 8 --gpu-memory 40GiB

Block class: ``T5Block`` (``_no_split_modules``), in both the encoder and the decoder. The
batch is ``input_ids`` + ``labels``: the model shifts the labels into ``decoder_input_ids``
itself and returns ``.loss``. Needs ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import T5Config, T5ForConditionalGeneration

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=512),
    "t5-base": dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12),
    "t5-large": dict(d_model=1024, d_kv=64, d_ff=4096, num_layers=24, num_heads=16),
}


def build(
    size: str = "tiny",
    batch_size: int = 2,
    seq_len: int = 32,
    target_len: int = 16,
    **overrides: Any,
) -> tuple[T5ForConditionalGeneration, dict[str, torch.Tensor]]:
    """``T5ForConditionalGeneration`` of ``size`` and a seq2seq batch (inputs and labels)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    cfg = T5Config(**{**SIZES[size], "decoder_start_token_id": 0, **overrides})
    model = T5ForConditionalGeneration(cfg)
    ids = torch.randint(1, cfg.vocab_size, (batch_size, seq_len), device="cpu")
    labels = torch.randint(1, cfg.vocab_size, (batch_size, target_len), device="cpu")
    return model, {"input_ids": ids, "labels": labels}
