"""A Vision Transformer classifier from a Hugging Face ``ViTConfig``: images in, no download.

    autoshard estimate examples/hf_vit.py:build --arg size=vit-huge --gpus 8 --gpu-memory 40GiB

Block class: ``ViTLayer`` (from ``_no_split_modules``). The batch is ``pixel_values`` and
integer class ``labels``; the model returns its cross-entropy ``.loss``. Needs ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import ViTConfig, ViTForImageClassification

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, image_size=32, patch_size=8, num_labels=10),
    "vit-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     intermediate_size=3072, image_size=224, patch_size=16, num_labels=1000),
    "vit-huge": dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16,
                     intermediate_size=5120, image_size=224, patch_size=14, num_labels=1000),
}  # fmt: skip


def build(
    size: str = "tiny", batch_size: int = 2, **overrides: Any
) -> tuple[ViTForImageClassification, dict[str, torch.Tensor]]:
    """``ViTForImageClassification`` of ``size`` and a batch of images with class labels."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    cfg = ViTConfig(**{**SIZES[size], **overrides})
    model = ViTForImageClassification(cfg)
    pixels = torch.randn(batch_size, 3, cfg.image_size, cfg.image_size, device="cpu")
    labels = torch.randint(0, cfg.num_labels, (batch_size,), device="cpu")
    return model, {"pixel_values": pixels, "labels": labels}
