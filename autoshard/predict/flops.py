"""FLOPs of one training step, counted on fake tensors: the compute term of the step-time model
(:mod:`autoshard.predict.speed`).

:func:`profile_flops` runs the forward and the backward of the model at micro-batch 1 and the
workload's sequence length under ``FakeTensorMode`` (shapes only, no memory, no arithmetic) and
counts them with torch's ``FlopCounterMode`` (matrix products, convolutions, attention), per
block and outside the blocks. FLOPs are linear in the micro-batch but attention is quadratic in
the sequence, so the profile is taken at the real sequence length and scaled by micro-batch only.

Repeated blocks (same class and shapes, same input shapes) are counted once, the way
:mod:`autoshard.predict.activations` profiles them: in the model's forward, every block is
replaced by a stand-in that returns outputs of the right shapes and a zero gradient, so the
model's own pass counts only what lies outside the blocks; each distinct block is counted alone,
forward and backward. A 70B model costs one block and its embedding and head.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from autoshard.config import WorkloadSpec
from autoshard.predict.activations import (
    _first_sample,
    _fresh_like,
    _materialize,
    _shapes,
    _signature,
)
from autoshard.results import ModelProfile
from autoshard.target.step import compute_loss, find_vocab_size, forward, move_to

aten = torch.ops.aten


class FlopProfile(BaseModel):
    """FLOPs of one sample's forward and backward (micro-batch 1), per block and outside them.

    >>> import torch
    >>> from torch import nn
    >>> from autoshard import WorkloadSpec, analyze_model
    >>> from autoshard.predict.flops import profile_flops
    >>> with torch.device("meta"):
    ...     model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    >>> flops = profile_flops(model, analyze_model(model), WorkloadSpec(),
    ...                       batch=torch.randn(8, 64))
    >>> flops.block_forward  # 2 x 64 x 64 multiply-adds per sample and Linear
    (8192, 8192, 8192, 8192)
    >>> flops.forward, flops.backward  # the first Linear's input needs no gradient
    (32768, 57344)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: int | None = Field(None, description="Sequence length the profile was taken at.")
    block_forward: tuple[int, ...] = Field((), description="Forward FLOPs of each block, in order.")
    block_backward: tuple[int, ...] = Field(
        (), description="Backward FLOPs of each block (input and weight gradients)."
    )
    other_forward: int = Field(0, description="Forward FLOPs outside the blocks (embedding, head).")
    other_backward: int = Field(0, description="Backward FLOPs outside the blocks.")
    measured: bool = Field(True, description="False when estimated as 6 x parameters x tokens.")
    note: str = Field("", description="Why the FLOPs were estimated, when they were.")

    @property
    def forward(self) -> int:
        """Forward FLOPs of one sample."""
        return sum(self.block_forward) + self.other_forward

    @property
    def backward(self) -> int:
        """Backward FLOPs of one sample."""
        return sum(self.block_backward) + self.other_backward

    @property
    def total(self) -> int:
        """Forward and backward FLOPs of one sample (what a step computes without recompute)."""
        return self.forward + self.backward


# ---------------------------------------------------------------------------------------------
# Attention on fake CPU tensors
# ---------------------------------------------------------------------------------------------

# On fake CPU tensors SDPA dispatches to the CPU flash kernel, which torch's counter does not
# know (it counts the CUDA kernels only): without these, attention would count zero FLOPs.
# A causal kernel skips the masked half of the score matrix (flash attention's tiles above the
# diagonal; torch's own formulas ignore the mask, "NB: We aren't accounting for causal
# attention here"), and the step time follows the work done: half the attention FLOPs.


def _cpu_flash_forward(
    query: Any, key: Any, value: Any, dropout_p: float = 0.0, is_causal: bool = False,
    *args: Any, out_shape: Any = None, **kwargs: Any,
) -> int:  # fmt: skip
    flops = sdpa_flop_count(query, key, value)
    return flops // 2 if is_causal else flops


def _cpu_flash_backward(
    grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any,
    dropout_p: float = 0.0, is_causal: bool = False, *args: Any, out_shape: Any = None,
    **kwargs: Any,
) -> int:  # fmt: skip
    flops = sdpa_backward_flop_count(grad_out, query, key, value)
    return flops // 2 if is_causal else flops


_CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def _counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION)


# ---------------------------------------------------------------------------------------------
# Stand-ins for blocks
# ---------------------------------------------------------------------------------------------


class _StandIn(torch.autograd.Function):
    """A block's outputs without its computation: fresh tensors of the recorded shapes that
    depend on the block's inputs, so the backward still reaches what came before the block
    (a patch embedding's convolution), with a zero gradient that costs no FLOPs."""

    @staticmethod
    def forward(ctx: Any, templates: tuple[torch.Tensor, ...], *inputs: torch.Tensor) -> Any:
        ctx.inputs = [(tuple(t.shape), t.dtype) for t in inputs]
        return tuple(torch.empty_like(t) for t in templates)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (None, *(torch.zeros(shape, dtype=dtype) for shape, dtype in ctx.inputs))


def _stand_in(template: Any, args: Any) -> Any:
    """Outputs shaped like ``template`` (a block's recorded output), attached to ``args``."""
    leaves, spec = tree_flatten(template)
    floats = [i for i, t in enumerate(leaves) if _differentiable(t)]
    inputs = [t for t in tree_flatten(args)[0] if _differentiable(t) and t.requires_grad]
    out = [_fresh_like(t) if isinstance(t, torch.Tensor) else t for t in leaves]
    if floats and inputs:
        made = _StandIn.apply(tuple(leaves[i] for i in floats), *inputs)
        for i, tensor in zip(floats, made, strict=True):
            out[i] = tensor
    return tree_unflatten(out, spec)


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _float_outputs(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if _differentiable(t) and t.requires_grad]


def _backward(output: Any) -> None:
    outs = _float_outputs(output)
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


# ---------------------------------------------------------------------------------------------
# The profile
# ---------------------------------------------------------------------------------------------


def profile_flops(
    model: nn.Module,
    profile: ModelProfile,
    workload: WorkloadSpec,
    batch: Any | None = None,
) -> FlopProfile:
    """Count the FLOPs of one sample's forward and backward on fake tensors, per block (the
    profile's checkpoint classes) and outside the blocks. A model whose forward does not run on
    fake tensors gets an estimate of 6 x parameters x tokens, said in ``note``.

    >>> from autoshard import TargetSpec, WorkloadSpec, analyze_target
    >>> from autoshard.predict.flops import profile_flops
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> flops = profile_flops(built.model, profile, WorkloadSpec(seq_len=128))
    >>> flops.measured, len(flops.block_forward)
    (True, 4)
    >>> round(flops.block_backward[1] / flops.block_forward[1], 2)  # input and weight grads
    2.04
    """
    try:
        if any(not p.is_meta for p in model.parameters()):
            raise ValueError("profile_flops needs a model built on the meta device")
        if batch is not None:
            batch = _first_sample(batch)
        else:
            if find_vocab_size(model) is None or workload.seq_len is None:
                raise ValueError("no example batch and no sequence length")
            batch = torch.zeros(1, workload.seq_len, dtype=torch.long)
        return _count(model, profile, batch, workload.seq_len)
    except Exception as exc:  # a forward that cannot run on fake tensors: estimate, say so
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return six_n_t(profile, workload, why)


def _count(
    meta_model: nn.Module, profile: ModelProfile, batch: Any, seq: int | None
) -> FlopProfile:
    from autoshard.sharding import wrap_classes_of

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = copy.deepcopy(meta_model)  # a meta copy costs nothing
    block_types = tuple(wrap_classes_of(model, profile.checkpoint_policy))
    blocks = [m for m in model.modules() if block_types and isinstance(m, block_types)]
    signatures = {id(block): _signature(block) for block in blocks}
    # Blocks repeating an earlier one's signature stay on meta until one has to run.
    seen: set[Any] = set()
    repeats: set[int] = set()
    for block in blocks:
        if signatures[id(block)] in seen:
            repeats.add(id(block))
        seen.add(signatures[id(block)])
    in_repeats = {id(m) for b in blocks if id(b) in repeats for m in b.modules()}
    with fake:
        for module in model.modules():
            if id(module) not in in_repeats:
                _materialize(module, torch.float32, recurse=False)
        batch = move_to(batch, torch.device("cpu"))

    counter = _counter()
    forward_flops = [0] * len(blocks)
    # (signature, input shapes) -> (the block, fresh inputs, output template, forward FLOPs)
    distinct: dict[Any, tuple[nn.Module, Any, Any, int]] = {}
    keys: list[Any] = [None] * len(blocks)

    def standing_in(index: int, block: nn.Module) -> Any:
        original = block.forward

        def stand_in_forward(*args: Any, **kwargs: Any) -> Any:
            key = (signatures[id(block)], _shapes((args, kwargs)))
            keys[index] = key
            if key not in distinct:
                if any(p.is_meta for p in block.parameters()):  # a repeat with a new input
                    _materialize(block, torch.float32, recurse=True)
                before = counter.get_total_flops()
                output = original(*args, **kwargs)
                flops = counter.get_total_flops() - before
                distinct[key] = (block, _fresh_like((args, kwargs)), _fresh_like(output), flops)
            forward_flops[index] = distinct[key][3]
            return _stand_in(distinct[key][2], (args, kwargs))

        stand_in_forward.original = original  # type: ignore[attr-defined]
        return stand_in_forward

    for index, block in enumerate(blocks):
        block.forward = standing_in(index, block)
    with fake:
        with counter:
            output = forward(model, batch)
            forward_total = counter.get_total_flops()
            _backward_of_loss(output, batch)
        total = counter.get_total_flops()
        # Each distinct block alone, its inner blocks (if any) still standing in.
        backward_of: dict[Any, int] = {}
        for key, (block, (args, kwargs), _, _) in distinct.items():
            alone = _counter()
            with alone:
                out = block.forward.original(*args, **kwargs)  # type: ignore[attr-defined]
                before = alone.get_total_flops()
                _backward(out)
            backward_of[key] = alone.get_total_flops() - before
            for p in block.parameters():
                p.grad = None
    if blocks and any(k is None for k in keys):
        raise RuntimeError("some blocks did not run in the model's forward")
    return FlopProfile(
        seq_len=seq,
        block_forward=tuple(forward_flops),
        block_backward=tuple(backward_of[k] for k in keys),
        other_forward=forward_total - sum(distinct[k][3] for k in distinct),
        other_backward=total - forward_total,
    )


def _backward_of_loss(output: Any, batch: Any) -> None:
    """The backward of the step's loss (the model's own, or next-token cross-entropy), or of
    every floating output when no loss can be made from it: the same matrix products."""
    try:
        loss = compute_loss(output, batch)
    except Exception:
        _backward(output)
        return
    if loss.requires_grad:
        loss.backward()


def six_n_t(profile: ModelProfile, workload: WorkloadSpec, why: str) -> FlopProfile:
    """The rule of thumb (Kaplan et al. 2020): 2 FLOPs per parameter and token forward, 4
    backward; attention's sequence-squared term is left out."""
    tokens = workload.seq_len or 1
    blocks = max(profile.block_count, 0)
    block = 2 * profile.block_params * tokens
    other = 2 * max(profile.total_params - blocks * profile.block_params, 0) * tokens
    return FlopProfile(
        seq_len=workload.seq_len,
        block_forward=(block,) * blocks,
        block_backward=(2 * block,) * blocks,
        other_forward=other,
        other_backward=2 * other,
        measured=False,
        note=f"FLOPs estimated as 6 x parameters x tokens: the forward did not run on fake "
        f"tensors ({why})",
    )
