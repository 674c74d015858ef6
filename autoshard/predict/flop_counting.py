"""Counting what operations on fake tensors cost, for the FLOP profile
(:mod:`autoshard.predict.flops`): FLOPs (torch's ``FlopCounterMode``, with the CPU's fused
attention kernel), the bytes memory-bound operations move, the kernels launched, the new tensors
written, and of those, what the operations selective checkpointing keeps account for (the rest
is its recompute).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from autoshard.sharding import selective_policy

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# Attention on fake CPU tensors
# ---------------------------------------------------------------------------------------------

# On fake CPU tensors SDPA dispatches to the CPU flash kernel, which torch's counter does not
# know (it counts the CUDA kernels only): without these, attention would count zero FLOPs.
# A causal kernel skips the masked half of the score matrix (flash attention's tiles above the
# diagonal; torch's own formulas ignore the mask, "NB: We aren't accounting for causal
# attention here"), and the step time follows the work done: half the attention FLOPs.


def _cpu_flash_forward(
    query: Any, key: Any, value: Any, *rest: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    """The forward's FLOPs: ``rest`` is the schema's (dropout_p, is_causal)."""
    key, value = _query_heads(query, key), _query_heads(query, value)
    flops = sdpa_flop_count(query, key, value)
    return flops // 2 if _causal(rest, kwargs, at=1) else flops


def _cpu_flash_backward(
    grad_out: Any, query: Any, key: Any, value: Any, *rest: Any, out_shape: Any = None,
    **kwargs: Any,
) -> int:  # fmt: skip
    """The backward's FLOPs: ``rest`` is the schema's (out, logsumexp, dropout_p, is_causal)."""
    key, value = _query_heads(query, key), _query_heads(query, value)
    flops = sdpa_backward_flop_count(grad_out, query, key, value)
    return flops // 2 if _causal(rest, kwargs, at=3) else flops


def _causal(rest: tuple[Any, ...], kwargs: dict[str, Any], *, at: int) -> bool:
    """The call's ``is_causal``: ``rest[at]`` as the schema places it, by name if the call named
    it, False (its default) where the call left it out. Torch's own formulas name only the
    shapes they read, the rest in ``*args``: these do the same."""
    return bool(rest[at]) if len(rest) > at else bool(kwargs.get("is_causal", False))


def _query_heads(query: Any, kv: Any) -> Any:
    """A key or value shape with the query's heads. Grouped-query attention (fewer key/value
    heads) computes per query head, as if each key/value head were repeated: torch 2.13's
    formulas count it so; torch 2.11's refuse the shapes ("query/key/value shapes are
    incompatible"), and the whole FLOP profile fell back to 6 x parameters x tokens."""
    b, h_q, *_ = query
    _, h_kv, s, d = kv
    return (b, h_q, s, d) if h_kv != h_q and h_kv and h_q % h_kv == 0 else kv


_CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


class _Traffic(TorchDispatchMode):
    """Operations that run a kernel (not views), the bytes read and written by those that are
    not matrix products or attention (each input tensor once and each output, as an eager
    kernel moves them through memory; allocating, ``empty``, moves nothing), and the bytes of
    new tensors every operation (matrix products too) returns."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops = 0
        self.fresh = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        name = packet.__name__
        if not outs or name.startswith("empty") or name.startswith("new_empty"):
            return out
        ins = {id(t): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        in_place = any(
            r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns
        )
        storages = {t.untyped_storage()._cdata for t in ins.values()}
        if not in_place and any(t.untyped_storage()._cdata in storages for t in outs):
            return out  # a view of an input
        self.ops += 1
        written = 0 if in_place else sum(_nbytes(t) for t in outs)
        self.fresh += written
        if packet in _COMPUTE_BOUND:
            return out
        if name in ("embedding", "index_select"):  # reads the rows it returns, not the table
            read = written + sum(_nbytes(t) for t in ins.values() if not t.is_floating_point())
        elif name.endswith("_like"):  # zeros_like, ones_like...: the input gives a shape only
            read = 0
        else:
            read = sum(_nbytes(t) for t in ins.values())
        self.bytes += read + written
        return out


_COMPUTE_BOUND = set(flop_registry) | set(_CPU_ATTENTION)
# Fused attention kernels (forward and backward), counted apart from the matrix products: they
# reach a different share of the GPU's peak (FlashAttention-2: ~35% of an H100's, against ~80%
# for large matrix products), and their FLOPs grow with the square of the sequence.
_ATTENTION = {
    packet for packet in _COMPUTE_BOUND if "attention" in getattr(packet, "__name__", str(packet))
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class OpCounts(NamedTuple):
    flops: int
    traffic: int
    ops: int
    attention: int = 0  # the part of ``flops`` that is fused attention
    fresh: int = 0  # bytes of the new tensors the operations return
    # Of the above, what the operations selective checkpointing keeps count (inside blocks)
    kept_flops: int = 0
    kept_traffic: int = 0
    kept_ops: int = 0
    kept_attention: int = 0
    kept_fresh: int = 0

    @property
    def work(self) -> tuple[int, int, int, int, int]:
        """(flops, traffic, ops, attention, fresh)."""
        return self.flops, self.traffic, self.ops, self.attention, self.fresh

    @property
    def recomputed(self) -> tuple[int, int, int, int, int]:
        """What selective checkpointing runs again: all but what it keeps, field by field."""
        kept = (self.kept_flops, self.kept_traffic, self.kept_ops, self.kept_attention,
                self.kept_fresh)  # fmt: skip
        return tuple(a - b for a, b in zip(self.work, kept, strict=True))  # type: ignore[return-value]

    def __sub__(self, other: tuple[int, ...]) -> OpCounts:
        return OpCounts(*(a - b for a, b in zip(self, other, strict=True)))

    def plus(self, other: tuple[int, ...]) -> OpCounts:
        """Field by field (``+`` of a tuple concatenates)."""
        return OpCounts(*(a + b for a, b in zip(self, other, strict=True)))


class OpCounter:
    """FLOPs (torch's counter, with CPU attention) and memory traffic, counted together, and
    the part of them that selective checkpointing keeps (``kept.start_block`` and ``end_block``
    around a block's call)."""

    def __init__(self) -> None:
        self.flop_counter = FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)
        self.traffic = _Traffic()
        self.kept = _Kept(self)

    def totals(self) -> OpCounts:
        by_op = self.flop_counter.get_flop_counts().get("Global", {})
        attention = sum(n for op, n in by_op.items() if op in _ATTENTION)
        work = (
            self.flop_counter.get_total_flops(),
            self.traffic.bytes,
            self.traffic.ops,
            attention,
            self.traffic.fresh,
        )
        return OpCounts(*work, *self.kept.counts)

    def __enter__(self) -> OpCounter:
        self.flop_counter.__enter__()
        self.traffic.__enter__()  # innermost: sees each operation once, before any decomposition
        self.kept.__enter__()  # above them: measures what a kept operation adds to their counts
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kept.__exit__(*exc)
        self.traffic.__exit__(*exc)
        self.flop_counter.__exit__(*exc)


class _Kept(TorchDispatchMode):
    """Inside a block's call, what each operation that :func:`autoshard.sharding.selective_policy`
    saves adds to the counter's FLOPs, traffic, kernels and new bytes: selective checkpointing
    does not run those again."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter
        self.counts = (0, 0, 0, 0, 0)
        self.depth = 0  # blocks running
        self.policy = selective_policy()
        self.ctx = SelectiveCheckpointContext(is_recompute=False)

    def start_block(self) -> None:
        """A block's call starts: a fresh policy, one per checkpointed call as ``context_fn``
        makes it."""
        self.depth += 1
        self.policy = selective_policy()

    def end_block(self) -> None:
        self.depth -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.depth:
            return func(*args, **kwargs)
        # the policy decides by the operation alone (and its count), so before running it
        decision = self.policy(self.ctx, func, *args, **kwargs)
        if decision not in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            return func(*args, **kwargs)
        before = self.counter.totals().work
        out = func(*args, **kwargs)
        after = self.counter.totals().work
        self.counts = tuple(  # type: ignore[assignment]
            c + a - b for c, a, b in zip(self.counts, after, before, strict=True)
        )
        return out
