"""GPT-2 from a Hugging Face ``GPT2Config``: tied input and output embeddings, no download.

    autoshard estimate examples/hf_gpt2.py:build --arg size=124m --gpus 8 --gpu-memory 24GiB

Block class: ``GPT2Block`` (``_no_split_modules``). ``lm_head.weight`` is ``transformer.wte.weight``
(one tensor under two names): autoshard keeps it in the root FSDP unit. The batch carries
``labels``, so the model returns its own ``.loss``. Needs ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=512,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "124m": dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
    "1.5b": dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024),
}


def build(
    size: str = "tiny", batch_size: int = 2, seq_len: int = 32, **overrides: Any
) -> tuple[GPT2LMHeadModel, dict[str, torch.Tensor]]:
    """``GPT2LMHeadModel`` of ``size`` and a causal-LM batch (``input_ids`` and ``labels``)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    cfg = GPT2Config(**{**SIZES[size], **overrides})
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device="cpu")
    return model, {"input_ids": ids, "labels": ids}
