"""A GPT-style decoder whose size is set by arguments, from a few million to 70B parameters.

    autoshard analyze examples/gpt.py:build --arg size=70b
    autoshard tune examples/gpt.py:build --arg size=tiny --seq-len 128

``size`` picks a preset (its shapes follow GPT-2 and Llama 2); any explicit argument overrides
the preset. ``mlp="swiglu"`` with ``n_kv_head`` gives a Llama-style block (RMSNorm, grouped-query
attention); ``mlp="gelu"`` a GPT-2 block. ``fused_projections=False`` gives keys, values, gate and
up their own matrix products, as torchtitan and Hugging Face Llama lay them out (what op-level
selective checkpointing saves depends on it: it keeps every other matrix product). Attention is
``scaled_dot_product_attention``, so saved activations are linear in the sequence length.

The factory is meta-safe: autoshard calls it under ``torch.device("meta")`` and nothing reads a
tensor's values while building.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PRESETS: dict[str, dict[str, Any]] = {
    # A few million parameters: fast enough for real CPU trials in CI.
    "tiny": dict(n_layer=4, n_head=4, d_model=128, vocab_size=4096, mlp="gelu", max_seq_len=256),
    "small": dict(n_layer=6, n_head=8, d_model=512, vocab_size=8192, mlp="gelu", max_seq_len=512),
    "124m": dict(n_layer=12, n_head=12, d_model=768, vocab_size=50304, mlp="gelu"),
    "1b": dict(n_layer=16, n_head=32, d_model=2048, n_kv_head=8, ffn_hidden=8192, mlp="swiglu"),
    "7b": dict(n_layer=32, n_head=32, d_model=4096, ffn_hidden=11008, mlp="swiglu"),
    "13b": dict(n_layer=40, n_head=40, d_model=5120, ffn_hidden=13824, mlp="swiglu"),
    "70b": dict(n_layer=80, n_head=64, n_kv_head=8, d_model=8192, ffn_hidden=28672, mlp="swiglu"),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return norm.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, d_model: int, n_head: int, n_kv_head: int, fused: bool = True) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = d_model // n_head
        kv_dim = n_kv_head * self.head_dim
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        if fused:
            self.kv_proj = nn.Linear(d_model, 2 * kv_dim, bias=False)
        else:  # torchtitan's and Hugging Face Llama's layout: one matrix product each
            self.k_proj = nn.Linear(d_model, kv_dim, bias=False)
            self.v_proj = nn.Linear(d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        if hasattr(self, "kv_proj"):
            k, v = self.kv_proj(x).view(b, t, 2, self.n_kv_head, self.head_dim).unbind(2)
        else:
            k = self.k_proj(x).view(b, t, self.n_kv_head, self.head_dim)
            v = self.v_proj(x).view(b, t, self.n_kv_head, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int, kind: str, fused: bool = True) -> None:
        super().__init__()
        self.kind = kind
        swiglu = kind == "swiglu"
        self.up = nn.Linear(d_model, hidden * (2 if swiglu and fused else 1), bias=kind == "gelu")
        if swiglu and not fused:  # torchtitan's w1 (gate) and w3 (up): two matrix products
            self.gate = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=kind == "gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate"):
            return self.down(F.silu(self.gate(x)) * self.up(x))
        h = self.up(x)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.gelu(h))


class Block(nn.Module):
    """One transformer block: the unit FSDP should wrap and checkpoint."""

    def __init__(
        self, d_model: int, n_head: int, n_kv_head: int, ffn_hidden: int, mlp: str, fused: bool
    ):
        super().__init__()
        norm = RMSNorm if mlp == "swiglu" else nn.LayerNorm
        self.norm1 = norm(d_model)
        self.attn = Attention(d_model, n_head, n_kv_head, fused)
        self.norm2 = norm(d_model)
        self.mlp = MLP(d_model, ffn_hidden, mlp, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(
        self,
        *,
        n_layer: int,
        n_head: int,
        d_model: int,
        vocab_size: int = 32000,
        n_kv_head: int | None = None,
        ffn_hidden: int | None = None,
        mlp: str = "gelu",
        max_seq_len: int = 4096,
        tie_embeddings: bool = False,
        fused_projections: bool = True,
    ) -> None:
        super().__init__()
        if mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp must be 'gelu' or 'swiglu', not {mlp!r}")
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} is not a multiple of n_head={n_head}")
        self.vocab_size, self.max_seq_len = vocab_size, max_seq_len
        ffn_hidden = ffn_hidden or 4 * d_model
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model) if mlp == "gelu" else None
        self.blocks = nn.ModuleList(
            Block(d_model, n_head, n_kv_head or n_head, ffn_hidden, mlp, fused_projections)
            for _ in range(n_layer)
        )
        self.norm = RMSNorm(d_model) if mlp == "swiglu" else nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=std)
        for block in self.blocks:
            nn.init.normal_(block.mlp.down.weight, std=std / math.sqrt(2 * len(self.blocks)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def build(size: str = "tiny", freeze: str = "", **overrides: Any) -> GPT:
    """Build a GPT from a preset (``tiny``, ``small``, ``124m``, ``1b``, ``7b``, ``13b``, ``70b``)
    with any argument of :class:`GPT` overridden, e.g. ``build(size="7b", n_layer=48)``.

    ``freeze``: comma-separated parameter-name prefixes to freeze (``requires_grad=False``), as
    in fine-tuning, e.g. ``freeze="tok_emb"`` for a frozen embedding."""
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(PRESETS)}")
    model = GPT(**{**PRESETS[size], **overrides})
    prefixes = tuple(p for p in freeze.split(",") if p)
    for name, param in model.named_parameters():
        if name.startswith(prefixes):
            param.requires_grad_(False)
    return model
