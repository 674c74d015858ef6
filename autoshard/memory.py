"""Analytic per-rank memory of an FSDP candidate: pure arithmetic after one activation profile.

Activations come from the model itself, not a rule of thumb: :func:`profile_activations` runs
one forward on fake CPU tensors (shapes only, no memory) under ``saved_tensors_hooks`` and counts
the bytes autograd saves for backward, inside each block and outside them, plus each block's
input (all that checkpointing keeps), at each precision the candidates use (a bf16 forward saves
fp32 copies where the model upcasts). Saved bytes are linear in batch x sequence with SDPA, so
one profile at micro-batch 1 scales to every micro-batch.

The per-rank peak is the largest of the moments of a training step, each a sum of terms (see
``../shared/design.md``, "Memory", and :func:`peak_moments`): the loss at the end of forward,
the head's backward, the top and bottom blocks' backward, the root's backward, the optimizer
step, and with gloo each reduce-scatter. The terms:
- sharded parameters, gradients and optimizer states: ``P x bytes / shard_size``;
- the unsharded working set: the unit being computed and the prefetched next one (2 x largest
  unit in the compute dtype) and the root unit, or the whole model for SHARD_GRAD_OP (no
  reshard after forward);
- communication buffers: the reduce-scatter input of one unit in the reduce dtype;
- activations saved for backward, by the checkpointing choice; the loss's fp32 log-probabilities;
- temporaries: the logits and their gradient, one block's recomputed activations and gradients,
  the foreach optimizer's transient copy of the shard;
- buffers, and an allowance for what a CPU cannot see (CUDA context, NCCL, allocator slack).
Calibrated against torch's memory tracker on fake tensors (:mod:`autoshard.simulate`) and
checked against measured runs by ``benchmarks/estimate_accuracy.py``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autoshard.models import (
    Candidate,
    Checkpointing,
    Engine,
    Hardware,
    MemoryBreakdown,
    MemoryEstimate,
    ModelProfile,
    Optimizer,
    OptimizerImpl,
    Precision,
    Sharding,
    WorkloadSpec,
)
from autoshard.sharding import compute_dtype
from autoshard.step import find_vocab_size, forward, move_to

# What a CPU cannot see on a GPU: the CUDA context and cuBLAS workspace (about 0.5-1 GiB on
# recent GPUs), NCCL's buffers, and the caching allocator's reserved-over-allocated slack.
# Uncalibrated until a GPU run measures it (benchmarks/results/), so stated as an allowance.
CUDA_CONTEXT_BYTES = 1 * 1024**3
ALLOCATOR_SLACK = 0.05


def allowance(subtotal: int, hardware: Hardware) -> int:
    """What a CPU cannot see on a GPU, for a peak of ``subtotal`` counted bytes; nothing for CPU
    processes (gloo), where there is no CUDA context or caching allocator."""
    if hardware.backend == "gloo":
        return 0
    return CUDA_CONTEXT_BYTES + int(subtotal * ALLOCATOR_SLACK)


class ActivationProfile(BaseModel):
    """Bytes saved for backward per sample, measured on fake tensors at one precision (and, in
    ``others``, the same model measured at other precisions: see :meth:`at`).

    >>> import torch
    >>> from torch import nn
    >>> from autoshard import WorkloadSpec, analyze_model, profile_activations
    >>> with torch.device("meta"):
    ...     model = nn.Sequential(
    ...         *[nn.TransformerEncoderLayer(64, 4, 128, batch_first=True) for _ in range(4)])
    >>> acts = profile_activations(model, analyze_model(model), WorkloadSpec(seq_len=32),
    ...                            batch=torch.randn(2, 32, 64))
    >>> acts.measured, len(acts.block_bytes)
    (True, 4)
    >>> acts.block_input_bytes[0] < acts.block_bytes[0]  # what checkpointing keeps per block
    True
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: int | None = Field(None, description="Sequence length the profile was taken at.")
    precision: Precision = Field(Precision.FP32, description="Precision the forward ran at.")
    block_bytes: tuple[int, ...] = Field((), description="Saved inside each block, per sample.")
    block_input_bytes: tuple[int, ...] = Field((), description="Each block's input, per sample.")
    other_bytes: int = Field(0, description="Saved outside the blocks (embedding, head).")
    loss_bytes: int = Field(
        0, description="The loss's fp32 log-probabilities, per sample (fp32 at every precision)."
    )
    measured: bool = Field(True, description="False when the fake forward failed (estimated).")
    note: str = ""
    others: tuple[ActivationProfile, ...] = Field(
        (), description="The same model profiled at other precisions."
    )

    def at(self, precision: Precision | str) -> ActivationProfile:
        """The profile taken at ``precision`` (16-mixed saves what bf16-mixed does), or this one:
        :meth:`scale` then converts by element size only, which misses what a model keeps in
        fp32 under low precision (an RMSNorm's upcast: -10% on a 7B Llama shape, simulated)."""
        precision = Precision(precision)  # "bf16-mixed" finds the bf16 profile too
        wanted = Precision.BF16_MIXED if precision is Precision.FP16_MIXED else precision
        for acts in (self, *self.others):
            if acts.precision is wanted:
                return acts
        return self

    def scale(self, candidate: Candidate) -> float:
        """Bytes per profiled byte for ``candidate``: its micro-batch times the ratio of its
        compute element size to the profile's."""
        return (
            candidate.micro_batch_size * _bytes(candidate.precision)[1] / _bytes(self.precision)[1]
        )


@contextlib.contextmanager
def _block_hooks(
    model: nn.Module, blocks: list[nn.Module], stack: list[int]
) -> Iterator[list[int]]:
    inputs: list[int] = []
    handles = []
    for index, block in enumerate(blocks):

        def pre(_m: nn.Module, args: Any, index: int = index) -> None:
            stack.append(index)
            first = args[0] if args else None
            if isinstance(first, torch.Tensor):
                inputs.append(first.numel() * first.element_size())

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            stack.pop()

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
    try:
        yield inputs
    finally:
        for h in handles:
            h.remove()


def _signature(module: nn.Module) -> tuple[Any, ...]:
    """Blocks with the same class and the same parameter and buffer shapes save the same bytes
    for the same input: one is run, the others reuse its count."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple((n, tuple(t.shape), t.dtype) for n, t in tensors))


def _shapes(value: Any) -> Any:
    """A hashable description of a block's call arguments (tensors by shape and dtype)."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, dict):
        return tuple((k, _shapes(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
    if isinstance(value, list | tuple):
        return tuple(_shapes(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return type(value).__name__
    return value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def _fresh_like(value: Any) -> Any:
    """New fake tensors of the same shapes (no autograd history: nothing is saved twice)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value).requires_grad_(value.requires_grad)
    if isinstance(value, dict):
        return type(value)({k: _fresh_like(v) for k, v in value.items()})
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_fresh_like(v) for v in value)
    return value


def profile_activations(
    model: nn.Module,
    profile: ModelProfile,
    workload: WorkloadSpec,
    batch: Any | None = None,
    *,
    precisions: Sequence[Precision] = (Precision.FP32,),
) -> ActivationProfile:
    """Count what one forward at micro-batch 1 saves for backward, on fake tensors, at each of
    ``precisions`` (the first is returned, the others in its ``others``).

    Precision changes more than the element size: under autocast, norms and softmax save fp32,
    and a model that upcasts (``x.float()`` in an RMSNorm) saves an fp32 copy beside its bf16
    input that a fp32 forward never makes. Repeated blocks (same class and shapes, same input)
    are run once per precision; the others reuse the count.

    >>> from autoshard import TargetSpec, WorkloadSpec, analyze_target, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> acts = profile_activations(built.model, profile, WorkloadSpec(seq_len=128),
    ...                            precisions=("32-true", "bf16-mixed"))
    >>> acts.precision.value, [other.precision.value for other in acts.others]
    ('32-true', ['bf16-mixed'])
    >>> acts.at("bf16-mixed").block_bytes[0] < acts.block_bytes[0]  # bf16 saves fewer bytes
    True
    """
    seq = workload.seq_len
    try:
        if any(not p.is_meta for p in model.parameters()):
            raise ValueError("profile_activations needs a model built on the meta device")
        if batch is not None:
            batch = _first_sample(batch)
        else:
            if find_vocab_size(model) is None or seq is None:
                raise ValueError("no example batch and no sequence length")
            batch = torch.zeros(1, seq, dtype=torch.long)
        # 16-mixed saves what bf16-mixed does (2-byte compute, the same autocast lists)
        wanted = [Precision.BF16_MIXED if p is Precision.FP16_MIXED else p for p in precisions]
        profiles, failed = [], []
        for precision in dict.fromkeys(wanted):
            try:
                profiles.append(_profile_once(model, profile, batch, precision, seq))
            except Exception as exc:  # one precision failing leaves the others usable
                failed.append((precision, exc))
        if not profiles:
            raise failed[0][1]
        first, *others = profiles
        note = "; ".join(
            f"the forward did not run on fake tensors at {p.value} ({type(e).__name__}: {e}); "
            f"its activations are scaled from {first.precision.value}".splitlines()[0]
            for p, e in failed
        )
        return first.model_copy(update={"others": tuple(others), "note": note})
    except Exception as exc:  # a model whose forward cannot run on meta: fall back, say so
        return _rule_of_thumb(profile, workload, f"{type(exc).__name__}: {exc}".splitlines()[0])


def precisions_of(candidates: Sequence[Candidate]) -> tuple[Precision, ...]:
    """The precisions to profile for ``candidates``: theirs, and always fp32, which sizes the
    gradients of activations in every precision (see :func:`peak_moments`)."""
    return tuple(dict.fromkeys([*(c.precision for c in candidates), Precision.FP32]))


def _materialize(module: nn.Module, dtype: torch.dtype, *, recurse: bool) -> None:
    """Fake CPU tensors for ``module``'s meta parameters and buffers, floating ones in ``dtype``
    (what FSDP's param_dtype casts them to). Call under the fake mode."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if t.is_floating_point() else t.dtype
        return torch.empty_like(t, device="cpu", dtype=kind)

    module._apply(empty, recurse=recurse)


def _profile_once(
    meta_model: nn.Module,
    profile: ModelProfile,
    batch: Any,
    precision: Precision,
    seq: int | None,
) -> ActivationProfile:
    from autoshard.sharding import wrap_classes_of

    # Fake CPU tensors, not meta ones: on meta, SDPA takes the math path and saves the
    # seq x seq attention matrix; fake CPU tensors dispatch to the flash kernel, as on a GPU.
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = copy.deepcopy(meta_model)  # a meta copy costs nothing
    dtype = torch.float32 if precision is Precision.FP32 else compute_dtype(precision)
    block_types = tuple(wrap_classes_of(model, profile.checkpoint_policy))
    blocks = [m for m in model.modules() if block_types and isinstance(m, block_types)]
    # Blocks that repeat an earlier one's signature stay on meta until one has to run.
    # (Signatures are taken before materialising, which changes the dtypes of some blocks only.)
    signatures = {id(block): _signature(block) for block in blocks}
    first_of: set[tuple[Any, ...]] = set()
    repeats: set[int] = set()
    for block in blocks:
        # a block holding blocks always runs: its inner blocks count themselves
        nested = any(isinstance(m, block_types) for m in block.modules() if m is not block)
        if signatures[id(block)] in first_of and not nested:
            repeats.add(id(block))
        first_of.add(signatures[id(block)])
    in_repeats = {id(m) for b in blocks if id(b) in repeats for m in b.modules()}
    with fake:
        for module in model.modules():
            if id(module) not in in_repeats:
                _materialize(module, dtype, recurse=False)
        batch = move_to(batch, torch.device("cpu"))
    params = {p.untyped_storage()._cdata for p in model.parameters() if not p.is_meta}
    seen: dict[int, int] = {}  # storage -> bytes, each saved storage counted once
    stack: list[int] = []
    per_block = [0] * len(blocks)
    other = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal other
        key = t.untyped_storage()._cdata
        if key in params or key in seen:
            return t
        nbytes = seen[key] = t.untyped_storage().nbytes()
        if stack:
            per_block[stack[-1]] += nbytes
        else:
            other += nbytes
        return t

    counted: dict[Any, tuple[int, Any]] = {}  # (signature, input shapes) -> (saved, output)

    def counting(index: int, block: nn.Module) -> Any:
        original = block.forward
        signature = signatures[id(block)]

        def forward(*args: Any, **kwargs: Any) -> Any:
            key = (signature, _shapes((args, kwargs)))
            if id(block) in repeats and key in counted:
                saved, output = counted[key]
                per_block[index] += saved
                return _fresh_like(output)
            if any(p.is_meta for p in block.parameters()):  # a repeat with a new input
                _materialize(block, dtype, recurse=True)
                params.update(p.untyped_storage()._cdata for p in block.parameters())
            before, seen_before = per_block[index], set(seen)
            output = original(*args, **kwargs)
            # What the block saved of the tensors every block is given (rotary tables, masks)
            # is saved once: a repeat would find it already counted.
            shared = {
                t.untyped_storage()._cdata
                for t in _tensors((args[1:], kwargs))
                if t.untyped_storage()._cdata not in seen_before
            }
            own = per_block[index] - before - sum(seen.get(k, 0) for k in shared)
            counted.setdefault(key, (own, output))
            return output

        return forward

    autocast = (
        torch.autocast("cpu", dtype=dtype)
        if precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)
        else contextlib.nullcontext()
    )
    for index, block in enumerate(blocks):
        block.forward = counting(index, block)
    with fake, _block_hooks(model, blocks, stack) as inputs, autocast:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(model, batch)
        logits = getattr(out, "logits", out)
        loss = 0
        if isinstance(logits, torch.Tensor) and logits.requires_grad:
            # the loss saves the log-probabilities of the logits, in fp32 even under autocast
            loss = logits.numel() * 4
    return ActivationProfile(
        seq_len=seq,
        precision=precision,
        block_bytes=tuple(per_block),
        block_input_bytes=tuple(inputs[: len(blocks)]),
        other_bytes=other,
        loss_bytes=loss,
    )


def _first_sample(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:1] if batch.dim() else batch
    if isinstance(batch, dict):
        return {k: _first_sample(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_first_sample(v) for v in batch)
    return batch


def _rule_of_thumb(profile: ModelProfile, workload: WorkloadSpec, why: str) -> ActivationProfile:
    """Transformer activations per block (Korthikanti et al.: ~34 x seq x hidden bytes in 16
    bits, so ~68 in fp32), when the forward cannot be traced on meta."""
    seq = workload.seq_len or 1
    hidden = profile.hidden_size or int(math.sqrt(max(profile.block_params, 1) / 12)) or 1
    n = max(profile.block_count, 1)
    return ActivationProfile(
        seq_len=workload.seq_len,
        block_bytes=tuple([68 * seq * hidden] * n),
        block_input_bytes=tuple([4 * seq * hidden] * n),
        other_bytes=4 * seq * hidden,
        loss_bytes=4 * seq * (profile.vocab_size or hidden),
        measured=False,
        note=f"the forward did not run on fake tensors ({why}); activations estimated",
    )


def _bytes(precision: Precision) -> tuple[int, int]:
    """(bytes of stored parameters, bytes of the compute dtype)."""
    stored = 2 if precision is Precision.BF16_TRUE else 4
    return stored, compute_dtype(precision).itemsize


def as_run(candidate: Candidate, hardware: Hardware) -> Candidate:
    """The configuration the engine runs: FSDP1 on a world of one rank switches every sharding
    strategy to NO_SHARD (``FullyShardedDataParallel`` warns and does so; parameters then stay
    whole, no unsharded copies are gathered), while FSDP2 shards over the one rank as asked."""
    if (
        candidate.engine is Engine.FSDP1
        and hardware.world_size == 1
        and candidate.sharding is not Sharding.NO_SHARD
    ):
        return candidate.model_copy(update={"sharding": Sharding.NO_SHARD, "hybrid_mesh": None})
    return candidate


def shard_size(candidate: Candidate, hardware: Hardware) -> int:
    match candidate.sharding:
        case Sharding.NO_SHARD:
            return 1
        case Sharding.HYBRID_SHARD:
            assert candidate.hybrid_mesh is not None
            return candidate.hybrid_mesh[1]
        case Sharding.FULL_SHARD | Sharding.SHARD_GRAD_OP:
            return hardware.world_size
        case _:
            raise ValueError(f"unknown sharding {candidate.sharding!r}")


def activation_bytes(candidate: Candidate, acts: ActivationProfile) -> tuple[int, int]:
    """(saved activations, recompute transient) for the candidate's micro-batch, in bytes."""
    acts = acts.at(candidate.precision)
    scale = acts.scale(candidate)
    blocks, inputs = acts.block_bytes, acts.block_input_bytes
    largest = max(blocks, default=0)
    match candidate.checkpointing:
        case Checkpointing.NONE:
            saved = sum(blocks)
            recompute = 0
        case Checkpointing.ALL | Checkpointing.EVERY_K:
            every = (
                candidate.checkpoint_every
                if candidate.checkpointing is Checkpointing.EVERY_K
                else 1
            )
            saved = sum(
                (inputs[i] if i < len(inputs) else 0) if i % every == 0 else b
                for i, b in enumerate(blocks)
            )
            recompute = largest  # one block's activations are rebuilt at a time in backward
        case _:
            raise ValueError(f"unknown checkpointing {candidate.checkpointing!r}")
    loss = candidate.micro_batch_size * acts.loss_bytes
    return int((saved + acts.other_bytes) * scale) + loss, int(recompute * scale)


def first_block_bytes(candidate: Candidate, acts: ActivationProfile) -> int:
    """What is still saved when the first block runs its backward: its own activations (its
    input under checkpointing) and what was saved before it (the embedding's)."""
    acts = acts.at(candidate.precision)
    scale = acts.scale(candidate)
    if not acts.block_bytes:
        return int(acts.other_bytes * scale)
    ckpt = candidate.checkpointing is not Checkpointing.NONE
    first = acts.block_input_bytes[0] if ckpt and acts.block_input_bytes else acts.block_bytes[0]
    return int((first + acts.other_bytes) * scale)


def peak_moments(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    acts: ActivationProfile,
) -> tuple[dict[str, MemoryBreakdown], int]:
    """The per-rank bytes at each moment that can hold the peak of a training step (before the
    allowance), and the host bytes per node.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec
    >>> from autoshard import analyze_target, peak_moments, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> workload = WorkloadSpec(seq_len=128)
    >>> moments, host = peak_moments(
    ...     profile, Candidate(wrap_classes=profile.wrap_policy),
    ...     Hardware(gpus_per_node=8, gpu_memory=80 * 2**30), workload,
    ...     profile_activations(built.model, profile, workload))
    >>> print(*moments, sep=", ")
    loss, head backward, top block backward, bottom block backward, root backward, optimizer step
    >>> host  # nothing offloaded
    0
    """
    candidate = as_run(candidate, hardware)
    stored, cb = _bytes(candidate.precision)
    params = profile.total_params
    shard = shard_size(candidate, hardware)
    # Without a wrap policy the whole model is one (root) unit: no block units to prefetch.
    wrapped = not candidate.one_unit
    unit = max(profile.block_params, 1) if wrapped else 0
    root = profile.root_unit_params if wrapped else params
    mixed = candidate.precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    sharded = params * stored // shard
    grads = params * stored // shard
    states = {Optimizer.ADAMW: 2, Optimizer.ADAM: 2, Optimizer.SGD: 1}[candidate.optimizer]
    optimizer = states * params * stored // shard

    if candidate.sharding is Sharding.SHARD_GRAD_OP:
        unsharded = params * cb  # kept gathered from forward to backward
        after_forward = unsharded
    elif candidate.sharding is Sharding.NO_SHARD:
        # low-precision copies of the current unit and the prefetched one (or of the one unit)
        unsharded = ((2 * unit if wrapped else params) * cb) if mixed else 0
        after_forward = 0
    else:
        unsharded = (2 * unit + root) * cb  # current + prefetched unit, and the root
        # When the loss is computed, FSDP2 has resharded the root too; FSDP1 keeps the root
        # gathered from forward into backward.
        after_forward = root * cb if candidate.engine is Engine.FSDP1 else 0
    # Lightning's FSDP1 reduces in the compute dtype; FSDP2 here reduces in fp32 when mixed.
    fp32_reduce = mixed and candidate.engine is Engine.FSDP2 and candidate.reduce_dtype_fp32
    reduce_bytes = 4 if fp32_reduce else cb
    # the reduce-scatter input of one unit, and (resharding after forward) the next unit's
    # all-gather output
    gather = unit * cb if shard > 1 and candidate.sharding is not Sharding.SHARD_GRAD_OP else 0
    if not wrapped and candidate.engine is Engine.FSDP2 and shard > 1:
        gather = params * cb  # FSDP2 copies the one unit out of its all-gather buffer
    comm = unit * reduce_bytes + gather

    # The gradients of a block's activations are made in the compute dtype, also where the
    # forward saved an fp32 upcast: sized from the fp32 profile when there is one.
    uniform = acts.at(Precision.FP32)
    acts = acts.at(candidate.precision)
    saved, recompute = activation_bytes(candidate, acts)
    loss_saved = candidate.micro_batch_size * acts.loss_bytes
    scale = acts.scale(candidate)
    block_grad = int(max(uniform.block_bytes, default=0) * uniform.scale(candidate))
    # A block's backward turns its saved activations into gradients as it goes: the moment holds
    # the larger of the two, not both. Under checkpointing the block first recomputes them, and
    # the peak comes about halfway through its backward (fitted to the simulation of a 7B shape
    # at 8 and 64 ranks: within 9% on both engines, where both in full was +18% and the larger
    # of the two -11%).
    if candidate.checkpointing is Checkpointing.NONE:
        block_backward = max(0, block_grad - int(max(acts.block_bytes, default=0) * scale))
    else:
        block_backward = recompute + block_grad // 2
    logits = 0
    if profile.vocab_size and workload.seq_len:
        # the logits' gradient in fp32 (cross-entropy)
        logits = candidate.micro_batch_size * workload.seq_len * profile.vocab_size * 4
    foreach = (
        params * stored // shard
        if candidate.optimizer_impl is OptimizerImpl.FOREACH
        and candidate.optimizer is not Optimizer.SGD
        else 0
    )

    block_grads = (params - root) * stored // shard  # the blocks' gradients, reduced to shards
    host = 0
    if candidate.cpu_offload:
        # parameters, gradients and optimizer state live in host memory; the GPU keeps the
        # working set only
        host = (sharded + grads + optimizer) * hardware.gpus_per_node
        sharded = grads = optimizer = foreach = block_grads = 0

    # Several moments compete for the peak (measured with torch's tracker, design notes "Memory");
    # gradients are set to None after each step, so backward starts without any.
    # 0. The loss, at the end of forward: every activation saved; the logits, their shifted
    #    copy (or fp32 cast) and the log-probabilities alive together.
    loss_moment = MemoryBreakdown(
        sharded_params=sharded,
        unsharded_params=after_forward,
        optimizer=optimizer,
        activations=saved,
        temporaries=2 * logits,
        buffers=profile.buffer_bytes,
    )
    # 1. The head's backward: the loss's backward is done (its log-probabilities freed), the
    #    logits' gradient alive, the root gathered again with the working set.
    head = MemoryBreakdown(
        sharded_params=sharded,
        unsharded_params=unsharded,
        optimizer=optimizer,
        comm_buffers=comm - unit * reduce_bytes,  # no block has reduced its gradients yet
        activations=saved - loss_saved,
        temporaries=logits,
        buffers=profile.buffer_bytes,
    )
    # 2. The top block's backward: the block recomputes under checkpointing and makes its
    #    gradients.
    resharded = wrapped and candidate.sharding in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)
    if not wrapped:  # the one unit stays gathered through backward
        top_block = head.model_copy(update={"temporaries": block_backward})
    elif resharded:
        # The root is resharded once the head's backward is done (torch 2.13, measured on fake
        # tensors): the blocks run without the root gathered or its gradient unsharded.
        top_block = head.model_copy(
            update={
                "unsharded_params": unsharded - root * cb,
                "temporaries": block_backward,
            }
        )
    elif candidate.sharding is Sharding.SHARD_GRAD_OP:
        # the top block's parameters are freed once its gradients are reduced
        top_block = head.model_copy(
            update={
                "unsharded_params": unsharded - unit * cb,
                "temporaries": block_backward,
            }
        )
    else:  # NO_SHARD: nothing is gathered or freed
        top_block = head.model_copy(update={"temporaries": block_backward})
    top_block = top_block.model_copy(update={"comm_buffers": comm})  # it reduces its gradients
    # 3. The bottom block's backward: the other blocks' activations are freed and their
    #    gradients reduced into shards; the root (the embedding) is prefetched in place of a
    #    next block. (SHARD_GRAD_OP holds everything all along: the top block is worse.)
    bottom_block = top_block.model_copy(
        update={
            "unsharded_params": (unit + root) * cb,
            "gradients": block_grads,
            "activations": first_block_bytes(candidate, acts),
        }
    )
    # 4. The root's backward, at the very end: the embedding's gradient completes the root's
    #    unsharded gradient, which is reduced (cast to the reduce dtype) into its shard; every
    #    block's gradient is already sharded. FSDP1 still holds the root gathered; FSDP2 has
    #    resharded it. Both copy the gradient into a reduce-scatter input beside it (simulated:
    #    FSDP2 too, even when no cast is needed); NO_SHARD all-reduces in place unless it casts.
    gathered_root = candidate.engine is Engine.FSDP1 and candidate.sharding is not Sharding.NO_SHARD
    root_backward = MemoryBreakdown(
        sharded_params=sharded,
        unsharded_params=root * cb if gathered_root or (mixed and shard == 1) else 0,
        gradients=block_grads + root * cb,
        optimizer=optimizer,
        comm_buffers=root * reduce_bytes if shard > 1 or reduce_bytes != cb else 0,
        activations=int(acts.other_bytes * scale),
        buffers=profile.buffer_bytes,
    )
    # 5. The optimizer step: gradients and the foreach transient, no activations.
    step = MemoryBreakdown(
        sharded_params=sharded,
        gradients=grads,
        optimizer=optimizer,
        temporaries=foreach,
        buffers=profile.buffer_bytes,
    )
    reduce_scatters = {}
    if hardware.backend == "gloo" and shard > 1:
        # gloo reduce-scatters a copy of its input (ProcessGroupGloo: +1x the input, measured
        # around a bare collective; NCCL works in place, all-reduce copies nothing). Each copy
        # lives while its unit's gradients are reduced: after the unit's backward temporaries
        # are freed and, in FSDP1, after the unit is resharded (simulated with the copy).
        if wrapped:
            last = bottom_block if resharded else top_block
            reduce_scatters["block reduce-scatter"] = last.model_copy(
                update={"temporaries": 0, "comm_buffers": last.comm_buffers + unit * reduce_bytes}
            )
        reduce_scatters["root reduce-scatter"] = root_backward.model_copy(
            update={
                "unsharded_params": root_backward.unsharded_params
                - (root * cb if gathered_root else 0),
                "comm_buffers": root_backward.comm_buffers + root * reduce_bytes,
            }
        )
    moments = {
        "loss": loss_moment,
        "head backward": head,
        "top block backward": top_block,
        **({"bottom block backward": bottom_block} if resharded else {}),
        "root backward": root_backward,
        "optimizer step": step,
        **reduce_scatters,
    }
    return moments, host


def estimate_memory(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    activations: ActivationProfile | None = None,
) -> MemoryEstimate:
    """Predict the per-rank GPU peak and per-node host memory of ``candidate``.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec
    >>> from autoshard import analyze_target, estimate_memory, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> workload = WorkloadSpec(seq_len=128)
    >>> acts = profile_activations(built.model, profile, workload)
    >>> gpus = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30)
    >>> full = estimate_memory(profile, Candidate(wrap_classes=profile.wrap_policy), gpus,
    ...                        workload, activations=acts)
    >>> full.method, full.fits, full.gpu_peak == full.breakdown.total
    ('analytic', True, True)
    >>> replicated = estimate_memory(
    ...     profile, Candidate(wrap_classes=profile.wrap_policy, sharding="NO_SHARD"), gpus,
    ...     workload, activations=acts)
    >>> replicated.breakdown.optimizer == 8 * full.breakdown.optimizer  # AdamW, 8 ranks
    True
    """
    acts = activations or _rule_of_thumb(profile, workload, "no activation profile given")
    moments, host = peak_moments(profile, candidate, hardware, workload, acts)
    peak_at, breakdown = max(moments.items(), key=lambda item: item[1].total)
    breakdown = breakdown.model_copy(update={"allowance": allowance(breakdown.total, hardware)})
    peak = breakdown.total
    usable = hardware.usable_gpu_memory
    reasons = []
    if peak > usable:
        reasons.append(f"needs {peak / 2**30:.1f} GiB per GPU, {usable / 2**30:.1f} GiB usable")
    if hardware.host_memory is not None and host > hardware.host_memory:
        reasons.append(f"needs {host / 2**30:.1f} GiB of host memory per node")
    return MemoryEstimate(
        candidate=candidate,
        method="analytic",
        peak_at=peak_at,
        gpu_peak=peak,
        host_peak=host,
        breakdown=breakdown,
        fits=not reasons,
        headroom=usable - peak,
        reason="; ".join(reasons),
    )


def estimate_all(
    profile: ModelProfile,
    candidates: Sequence[Candidate],
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    activations: ActivationProfile | None = None,
) -> list[MemoryEstimate]:
    """Estimate every candidate (milliseconds each).

    >>> from autoshard import Hardware, TargetSpec, WorkloadSpec, analyze_target
    >>> from autoshard import enumerate_candidates, estimate_all, profile_activations
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> gpus = Hardware(gpus_per_node=8, gpu_memory=2 * 2**30)
    >>> workload = WorkloadSpec(seq_len=128)
    >>> candidates = enumerate_candidates(profile, gpus, workload, micro_batch_sizes=(1, 256))
    >>> acts = profile_activations(built.model, profile, workload)
    >>> estimates = estimate_all(profile, candidates, gpus, workload, activations=acts)
    >>> 0 < sum(e.fits for e in estimates) < len(candidates)  # some of micro-batch 256 overflow
    True
    """
    return [
        estimate_memory(profile, c, hardware, workload, activations=activations) for c in candidates
    ]
