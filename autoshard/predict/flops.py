"""FLOPs of one training step, counted on fake tensors: the compute term of the step-time model
(:mod:`autoshard.predict.speed`).

:func:`profile_flops` runs the forward and the backward of the model at micro-batch 1 and the
workload's sequence length under ``FakeTensorMode`` (shapes only, no memory, no arithmetic) and
counts them with torch's ``FlopCounterMode`` (matrix products, convolutions, attention), per
block and outside the blocks. FLOPs are linear in the micro-batch but attention is quadratic in
the sequence, so the profile is taken at the real sequence length and scaled by micro-batch only.

Beside the FLOPs it counts the bytes the other operations read and write (normalisations,
activations, residual additions, casts, the loss: everything that is not a matrix product or
attention). Run one kernel each in eager PyTorch, they are bound by memory bandwidth, not FLOP/s:
on a GPU whose FLOP/s outgrew its memory bandwidth (an H100 has 3.2x an A100's FLOP/s and 1.6x
its bandwidth; an L4 120 TFLOP/s against 300 GB/s) they take a larger share of the step.

Repeated blocks (same class and shapes, same input shapes) are counted once, the way
:mod:`autoshard.predict.activations` profiles them: in the model's forward, every block is
replaced by a stand-in that returns outputs of the right shapes and a zero gradient, so the
model's own pass counts only what lies outside the blocks; each distinct block is counted alone,
forward and backward. A 70B model costs one block and its embedding and head.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoshard.config import WorkloadSpec
from autoshard.predict.dynamo_stand_in import without_dynamo
from autoshard.predict.fakes import (
    FakeModel,
    call_shapes,
    fake_forward_support,
    fake_model,
    fresh_like,
    sample_batch,
)
from autoshard.predict.flop_counting import OpCounter, OpCounts
from autoshard.results import ModelProfile
from autoshard.target.step import compute_loss, forward


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
    block_forward_traffic: tuple[int, ...] = Field(
        (),
        description="Bytes the forward's memory-bound operations of each block read and write, "
        "in fp32 (the step-time model scales them to the compute dtype).",
    )
    block_backward_traffic: tuple[int, ...] = Field(
        (), description="The same for each block's backward."
    )
    other_forward_traffic: int = Field(0, description="The same outside the blocks, forward.")
    other_backward_traffic: int = Field(0, description="The same outside the blocks, backward.")
    block_forward_ops: tuple[int, ...] = Field(
        (),
        description="Operations (kernels) of each block's forward, at any micro-batch: what "
        "launching them costs does not grow with the batch.",
    )
    block_backward_ops: tuple[int, ...] = Field((), description="The same for the backward.")
    other_forward_ops: int = Field(0, description="The same outside the blocks, forward.")
    other_backward_ops: int = Field(0, description="The same outside the blocks, backward.")
    block_forward_attention: tuple[int, ...] = Field(
        (),
        description="The part of each block's forward FLOPs that is fused attention (scaled dot "
        "product attention, flash or memory-efficient kernels): it runs at its own achievable "
        "rate, and grows with the square of the sequence.",
    )
    block_backward_attention: tuple[int, ...] = Field(
        (), description="The same for each block's backward."
    )
    other_forward_attention: int = Field(0, description="The same outside the blocks, forward.")
    other_backward_attention: int = Field(0, description="The same outside the blocks, backward.")
    block_forward_fresh: tuple[int, ...] = Field(
        (),
        description="Bytes of the new tensors each block's forward allocates (every operation's "
        "outputs, in fp32): what a process that maps its tensors afresh pays page faults for "
        "(CPU trial workers map those above 128 KiB so, which hold most of the bytes).",
    )
    block_backward_fresh: tuple[int, ...] = Field(
        (), description="The same for each block's backward."
    )
    other_forward_fresh: int = Field(0, description="The same outside the blocks, forward.")
    other_backward_fresh: int = Field(0, description="The same outside the blocks, backward.")
    block_selective_recompute: tuple[int, ...] = Field(
        (),
        description="Forward FLOPs of each block that selective (op-level) checkpointing runs "
        "again in backward: those of the operations its policy does not save "
        "(autoshard.sharding.selective_policy). Empty: not counted (estimated FLOPs).",
    )
    block_selective_recompute_attention: tuple[int, ...] = Field(
        (), description="The part of block_selective_recompute that is fused attention."
    )
    block_selective_recompute_traffic: tuple[int, ...] = Field(
        (), description="The same as block_forward_traffic, of what selective checkpointing reruns."
    )
    block_selective_recompute_ops: tuple[int, ...] = Field(
        (), description="The same as block_forward_ops, of what selective checkpointing reruns."
    )
    block_selective_recompute_fresh: tuple[int, ...] = Field(
        (), description="The same as block_forward_fresh, of what selective checkpointing reruns."
    )
    measured: bool = Field(True, description="False when estimated as 6 x parameters x tokens.")
    note: str = Field("", description="Why the FLOPs were estimated, when they were.")

    def block_parts(self, part: str, what: str) -> tuple[int, ...]:
        """``block_{part}_{what}`` (``part``: forward or backward; ``what``: attention,
        traffic, ops or fresh), one per block of ``block_{part}``, or zeros where the profile
        counted none of them (an estimate without a fake forward)."""
        n = len(getattr(self, f"block_{part}"))
        values: tuple[int, ...] = getattr(self, f"block_{part}_{what}")
        return values if len(values) == n else (0,) * n

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

    def selective_recompute(self) -> FlopProfile | None:
        """This profile with each block's forward replaced by what selective checkpointing runs
        again (the speed model times it as a forward); None where that was not counted."""
        if len(self.block_selective_recompute) != len(self.block_forward):
            return None
        return self.model_copy(
            update={
                "block_forward": self.block_selective_recompute,
                "block_forward_attention": self.block_selective_recompute_attention,
                "block_forward_traffic": self.block_selective_recompute_traffic,
                "block_forward_ops": self.block_selective_recompute_ops,
                "block_forward_fresh": self.block_selective_recompute_fresh,
            }
        )

    @property
    def selective_recompute_flops(self) -> int:
        """FLOPs of one sample that selective checkpointing of every block recomputes."""
        return sum(self.block_selective_recompute)

    @property
    def attention(self) -> int:
        """FLOPs of fused attention in one sample's forward and backward (part of ``total``)."""
        return (
            sum(self.block_forward_attention)
            + sum(self.block_backward_attention)
            + self.other_forward_attention
            + self.other_backward_attention
        )

    @property
    def traffic(self) -> int:
        """Bytes (fp32) of the memory-bound operations of one sample's forward and backward."""
        return (
            sum(self.block_forward_traffic)
            + sum(self.block_backward_traffic)
            + self.other_forward_traffic
            + self.other_backward_traffic
        )


# ---------------------------------------------------------------------------------------------
# Stand-ins for blocks
# ---------------------------------------------------------------------------------------------


class _StandIn(torch.autograd.Function):
    """A block's outputs without its computation: fresh tensors of the recorded shapes that
    depend on the block's inputs, so the backward still reaches what came before the block
    (a patch embedding's convolution), with a gradient that costs no FLOPs and moves no memory."""

    @staticmethod
    def forward(ctx: Any, templates: tuple[torch.Tensor, ...], *inputs: torch.Tensor) -> Any:
        ctx.inputs = [(tuple(t.shape), t.dtype) for t in inputs]
        return tuple(torch.empty_like(t) for t in templates)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        # On fake tensors a gradient's values do not matter: an empty one moves no memory.
        return (None, *(torch.empty(shape, dtype=dtype) for shape, dtype in ctx.inputs))


def _stand_in(template: Any, args: Any) -> Any:
    """Outputs shaped like ``template`` (a block's recorded output), attached to ``args``."""
    leaves, spec = tree_flatten(template)
    floats = [i for i, t in enumerate(leaves) if _differentiable(t)]
    inputs = [t for t in tree_flatten(args)[0] if _differentiable(t) and t.requires_grad]
    out = [fresh_like(t) if isinstance(t, torch.Tensor) else t for t in leaves]
    if floats and inputs:
        made = _StandIn.apply(tuple(leaves[i] for i in floats), *inputs)
        for i, tensor in zip(floats, made, strict=True):
            out[i] = tensor
    return tree_unflatten(out, spec)


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _float_outputs(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if _differentiable(t) and t.requires_grad]


def _backward(output: Any, counter: OpCounter | None = None) -> OpCounts:
    """Run the backward of every floating output (its gradients seeded with ones); return the
    counter's totals once the seeds are made, so that they are not counted as backward work."""
    outs = _float_outputs(output)
    seeds = [torch.ones_like(t) for t in outs]
    before = counter.totals() if counter is not None else OpCounts(0, 0, 0)
    if outs:
        torch.autograd.backward(outs, seeds)
    return before


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
        batch = sample_batch(model, batch, workload.seq_len, "profile_flops")
        with fake_forward_support():  # fp32 grouped_mm experts; torch's tracebacks kept out
            return without_dynamo(_count, model, profile, batch, workload.seq_len)
    except Exception as exc:  # a forward that cannot run on fake tensors: estimate, say so
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        return six_n_t(profile, workload, why)


def _count(
    meta_model: nn.Module, profile: ModelProfile, batch: Any, seq: int | None
) -> FlopProfile:
    fakes = fake_model(meta_model, profile.checkpoint_policy, batch)
    model, blocks = fakes.model, fakes.blocks
    counter = OpCounter()
    stand_ins = _StandIns(fakes, counter)
    for index, block in enumerate(blocks):
        block.forward = stand_ins.forward_of(index, block)
    with fakes.mode:
        with counter:
            output = forward(model, fakes.batch)
            forward_total = counter.totals()
            _backward_of_loss(output, fakes.batch)
        total = counter.totals()
        stand_ins.in_pass = False
        # Each distinct block alone, its inner blocks (if any) still standing in.
        backward_of: dict[Any, OpCounts] = {}
        for key, (block, inputs, _, _) in list(stand_ins.distinct.items()):
            backward_of[key] = _backward_of_block(block, inputs)
    if blocks and any(k is None for k in stand_ins.keys):
        raise RuntimeError("some blocks did not run in the model's forward")
    other_forward = forward_total - stand_ins.ran
    other_backward = total - forward_total  # the blocks' backward stood in: nothing counted
    backward_counts = [backward_of[k] for k in stand_ins.keys]
    return _flop_profile(
        seq, stand_ins.forward_counts, backward_counts, other_forward, other_backward
    )


_NONE = OpCounts(0, 0, 0)


class _StandIns:
    """The blocks' forwards in the counted pass (``forward_of``): each distinct block (signature,
    input shapes) runs once, counting what it computes without the blocks inside it; every other
    call stands in (:func:`_stand_in`) and counts nothing."""

    def __init__(self, fakes: FakeModel, counter: OpCounter) -> None:
        self.fakes = fakes
        self.counter = counter
        self.forward_counts: list[OpCounts] = [_NONE] * len(fakes.blocks)
        # (signature, input shapes) -> (the block, fresh inputs, output template, forward counts)
        self.distinct: dict[Any, tuple[nn.Module, Any, Any, OpCounts]] = {}
        self.keys: list[Any] = [None] * len(fakes.blocks)
        self.within: list[OpCounts] = []  # per running block: what the blocks inside it counted
        self.ran = _NONE  # what the blocks' own forwards counted in the model's pass
        self.in_pass = True  # the model's forward (False: a block's backward alone)

    def forward_of(self, index: int, block: nn.Module) -> Any:
        """The forward that replaces ``block``'s (its own kept as ``.original``)."""
        original = block.forward
        nested = id(block) in self.fakes.nested
        distinct = self.distinct

        def stand_in_forward(*args: Any, **kwargs: Any) -> Any:
            key = (self.fakes.signatures[id(block)], call_shapes((args, kwargs)))
            # A block holding blocks runs again in the model's pass, so that its inner blocks
            # are met and count themselves; alone, it stands in like the others.
            if key in distinct and not (nested and self.in_pass):
                if self.in_pass:
                    self.keys[index], self.forward_counts[index] = key, distinct[key][3]
                return _stand_in(distinct[key][2], (args, kwargs))  # nothing counted
            self.fakes.materialize(block)  # a repeat with a new input
            output, own = self._run_counted(original, args, kwargs)
            if self.in_pass:
                self.keys[index], self.forward_counts[index] = key, own
                self.ran = self.ran.plus(own)
            distinct.setdefault(key, (block, fresh_like((args, kwargs)), fresh_like(output), own))
            return _stand_in(distinct[key][2], (args, kwargs))

        stand_in_forward.original = original  # type: ignore[attr-defined]
        return stand_in_forward

    def _run_counted(self, original: Any, args: Any, kwargs: Any) -> tuple[Any, OpCounts]:
        """Run a block's own forward: its output, and what it counted without the blocks inside
        it (those add to the block around it, if any)."""
        before = self.counter.totals()
        self.within.append(_NONE)
        self.counter.kept.start_block()
        try:
            output = original(*args, **kwargs)
        finally:
            self.counter.kept.end_block()
            inner = self.within.pop()
        whole = self.counter.totals() - before
        own = whole - inner  # without the blocks inside it
        if self.within:
            self.within[-1] = self.within[-1].plus(whole)
        return output, own


def _flop_profile(
    seq: int | None,
    forward_counts: list[OpCounts],
    backward_counts: list[OpCounts],
    other_forward: OpCounts,
    other_backward: OpCounts,
) -> FlopProfile:
    """The profile of what each block's forward and backward and the rest of the step counted."""
    return FlopProfile(
        seq_len=seq,
        block_forward=tuple(c.flops for c in forward_counts),
        block_backward=tuple(c.flops for c in backward_counts),
        other_forward=other_forward.flops,
        other_backward=other_backward.flops,
        block_forward_traffic=tuple(c.traffic for c in forward_counts),
        block_backward_traffic=tuple(c.traffic for c in backward_counts),
        other_forward_traffic=other_forward.traffic,
        other_backward_traffic=other_backward.traffic,
        block_forward_ops=tuple(c.ops for c in forward_counts),
        block_backward_ops=tuple(c.ops for c in backward_counts),
        other_forward_ops=other_forward.ops,
        other_backward_ops=other_backward.ops,
        block_forward_attention=tuple(c.attention for c in forward_counts),
        block_backward_attention=tuple(c.attention for c in backward_counts),
        other_forward_attention=other_forward.attention,
        other_backward_attention=other_backward.attention,
        block_forward_fresh=tuple(c.fresh for c in forward_counts),
        block_backward_fresh=tuple(c.fresh for c in backward_counts),
        other_forward_fresh=other_forward.fresh,
        other_backward_fresh=other_backward.fresh,
        block_selective_recompute=tuple(c.recomputed[0] for c in forward_counts),
        block_selective_recompute_traffic=tuple(c.recomputed[1] for c in forward_counts),
        block_selective_recompute_ops=tuple(c.recomputed[2] for c in forward_counts),
        block_selective_recompute_attention=tuple(c.recomputed[3] for c in forward_counts),
        block_selective_recompute_fresh=tuple(c.recomputed[4] for c in forward_counts),
    )


def _backward_of_block(block: nn.Module, inputs: Any) -> OpCounts:
    """What the backward of ``block`` alone counts (:func:`_backward_alone`)."""
    try:
        return _backward_alone(block, inputs)
    except RuntimeError:
        # An object the block was given holds tensors of the model's pass, whose graph
        # its backward has freed (a Hugging Face key/value cache: GPT-2 builds one in
        # training unless its config says use_cache=False, T5's decoder even then):
        # count the block without it.
        return _backward_alone(block, _without_objects(inputs))


def _backward_alone(block: nn.Module, inputs: Any) -> OpCounts:
    """What the backward of ``block`` alone counts, on fresh ``(args, kwargs)``."""
    args, kwargs = inputs
    counter = OpCounter()
    try:
        with counter:
            out = block.forward.original(*args, **kwargs)  # type: ignore[attr-defined]
            before = _backward(out, counter)
    finally:
        for p in block.parameters():
            p.grad = None
    return counter.totals() - before


def _without_objects(value: Any) -> Any:
    """``value`` with every object that is not a tensor, a container or a plain value replaced
    by None."""
    if isinstance(value, torch.Tensor) or value is None:
        return value
    if isinstance(value, dict):
        return type(value)({k: _without_objects(v) for k, v in value.items()})
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_without_objects(v) for v in value)
    if isinstance(value, int | float | bool | str | torch.dtype | torch.device):
        return value
    return None


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
