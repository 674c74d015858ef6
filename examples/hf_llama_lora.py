"""A Llama from a Hugging Face ``LlamaConfig`` with peft LoRA adapters: only the adapters train.

    autoshard analyze examples/hf_llama_lora.py:build --arg size=8b
    autoshard estimate examples/hf_llama_lora.py:build --arg size=8b --gpus 8 --gpu-memory 80GiB

The base weights are frozen (``requires_grad=False``): they carry no gradient and no optimizer
state under FSDP2, while FSDP1 gives every unit holding an adapter a gradient of the unit's full
size (its flat parameter trains as one). No weights are downloaded.
Needs ``transformers`` and ``peft`` (``pip install autoshard[peft]``).
"""

from __future__ import annotations

from typing import Any

import torch
from hf_llama import config
from peft import LoraConfig, get_peft_model
from torch import nn


def build(
    size: str = "tiny",
    batch_size: int = 2,
    seq_len: int = 32,
    rank: int = 8,
    targets: str = "q_proj,v_proj",
    **overrides: Any,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``LlamaForCausalLM`` of ``size`` (see ``hf_llama.SIZES``) with rank-``rank`` LoRA
    adapters on the ``targets`` projections, and a causal-LM batch."""
    from transformers import LlamaForCausalLM

    cfg = config(size, **overrides)
    lora = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets.split(","), lora_dropout=0.0
    )
    model = get_peft_model(LlamaForCausalLM(cfg), lora)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device="cpu")
    return model, {"input_ids": ids, "labels": ids}
