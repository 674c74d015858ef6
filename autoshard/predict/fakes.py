"""Running a model on fake tensors: the set-up the predictors share, and what a model's forward
needs to run there the way it runs on real ones, and quietly.

The activation profile (:mod:`autoshard.predict.activations`) and the FLOP count
(:mod:`autoshard.predict.flops`) run one forward of a copy of the meta model on fake CPU tensors
(:func:`fake_model`), the simulation (:mod:`autoshard.predict.simulate`) whole training steps.
Repeated blocks (same class, parameter and buffer shapes: :func:`block_signature`) stay on meta
until one has to run; a block that holds blocks always runs, so that its inner blocks are met and
count themselves. Four things get in the way on fake tensors and not in a real run:

- ``aten._grouped_mm`` (Hugging Face's default mixture-of-experts kernel, ``grouped_mm``) has a
  fake/meta implementation written for CUDA's kernel, which takes bf16 only, while the CPU kernel
  takes every float dtype: an fp32 Mixtral trains on the CPU but its fake forward fails ("Expected
  inputs of BF16 type", torch 2.13, ``torch/_meta_registrations.py``). Under
  :func:`fake_forward_support` the fake kernel answers every float dtype as the CPU kernel does:
  the output shape of the bf16 meta kernel, in the inputs' dtype.
- ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` ask whether the mask they are given is
  the causal one (``torch.nn.modules.transformer._detect_is_causal_mask``: ``bool((mask ==
  causal).all())``), a question about values that fake tensors cannot answer
  (``DataDependentOutputException``): the seed guide's demo Transformer (Lightning's
  ``lightning.pytorch.demos.Transformer``) fell back to the rule of thumb. Under
  :func:`fake_forward_support` a fake mask of the sequence's square shape is taken as causal,
  which is what the check finds for the ``generate_square_subsequent_mask`` masks these classes
  are given; either answer runs the same attention FLOPs and saves the same tensors but the
  mask.
- Hugging Face models given no key/value cache (selective checkpointing turns it off) ask whether
  the batch packs several sequences per row (``transformers.masking_utils.
  find_packed_sequence_indices``): on real tensors they read the position ids, and the example
  batch's (the model's own ``arange``) are not packed, so attention runs with ``is_causal``; on
  fake tensors they cannot read them, take the batch as packed and build a seq x seq mask, with
  which SDPA copies grouped keys and values per head and saves a float mask per block (+6.7% on
  a 4-layer Llama at 512 tokens in fp32, simulated against measured). Under
  :func:`fake_forward_support` fake position ids are taken as one sequence per row; a batch that
  really packs sequences is estimated without its packing mask.
- When a fake kernel fails, torch logs the whole traceback at error level
  (``torch._subclasses.fake_tensor``: "failed while attempting to run meta for ...") before the
  exception reaches autoshard, which falls back and says so in one line. Those records are dropped
  while autoshard's fake forwards run.

The profiles run without loading ``torch._dynamo`` (1.2 s of CPU, a third of a 70B estimate, for
nothing a forward on fake tensors uses): see :mod:`autoshard.predict.dynamo_stand_in`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

# torch loggers that report a failing fake kernel with a traceback (torch 2.13)
_NOISY_LOGGERS = ("torch._subclasses.fake_tensor",)


@contextlib.contextmanager
def fake_forward_support() -> Iterator[None]:
    """Run fake-tensor forwards with :func:`grouped_mm_in_every_float_dtype`,
    :func:`causal_masks_by_shape`, :func:`unpacked_sequences` and without torch's tracebacks of
    failing fake kernels (:func:`quiet_fake_kernel_errors`)."""
    with (
        quiet_fake_kernel_errors(),
        grouped_mm_in_every_float_dtype(),
        causal_masks_by_shape(),
        unpacked_sequences(),
    ):
        yield


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Hugging Face's packed-sequence check answered "one sequence per row" for fake position
    ids (see the module's docstring); real ones are still read. Only where ``transformers`` is
    loaded already (a Hugging Face model was built): never imported here."""
    masking: Any = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def unpacked(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if isinstance(position_ids, FakeTensor) else find(position_ids)

    masking.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find


@contextlib.contextmanager
def causal_masks_by_shape() -> Iterator[None]:
    """``nn.Transformer*``'s causal-mask check answered from a fake mask's shape (see the
    module's docstring); real masks are still checked by value."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.nn.modules import transformer

    detect = getattr(transformer, "_detect_is_causal_mask", None)
    if detect is None:
        yield
        return

    def by_shape(mask: Any, is_causal: bool | None = None, size: int | None = None) -> bool:
        if is_causal is None and isinstance(mask, FakeTensor):
            side = size if size is not None else mask.size(-2)
            return tuple(mask.shape) == (side, side)
        return bool(detect(mask, is_causal, size))

    transformer._detect_is_causal_mask = by_shape
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect


@contextlib.contextmanager
def quiet_fake_kernel_errors() -> Iterator[None]:
    """Drop what torch's fake-tensor loggers log (a 20-line traceback per failing kernel); the
    exception itself still propagates."""

    def drop(_record: logging.LogRecord) -> bool:
        return False

    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def _grouped_mm_fake(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    mat_a, mat_b = args[0], args[1]
    if (
        mat_a.dtype == mat_b.dtype == torch.bfloat16
        or mat_a.dtype != mat_b.dtype
        or not mat_a.is_floating_point()
        or kwargs.get("out_dtype") is not None
    ):
        return NotImplemented  # torch's own fake kernel decides (and explains what it refuses)

    def meta(t: Any, dtype: torch.dtype | None = None) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device="meta")

    # Inside the fake mode's dispatch the modes are off: these are plain meta tensors.
    metas = [meta(mat_a, torch.bfloat16), meta(mat_b, torch.bfloat16)]
    rest = [meta(a) for a in args[2:]]
    shaped = func(*metas, *rest, **{k: meta(v) for k, v in kwargs.items()})
    out = torch.empty_strided(shaped.shape, shaped.stride(), dtype=mat_a.dtype, device="meta")
    return FakeTensor(fake_mode, out, mat_a.device)


@contextlib.contextmanager
def grouped_mm_in_every_float_dtype() -> Iterator[None]:
    """Let fake tensors run ``aten._grouped_mm`` in fp32 and fp16 as the CPU kernel does (see the
    module's docstring), for the duration of the block."""
    op = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)
    from torch._subclasses import fake_impls

    if op is None or op in fake_impls.op_implementations_dict:
        yield  # no such op in this torch, or a fake kernel of its own is registered
        return
    fake_impls.op_implementations_dict[op] = _grouped_mm_fake
    try:
        yield
    finally:
        fake_impls.op_implementations_dict.pop(op, None)


def experts_for_fake_tensors(model: Any) -> str:
    """Switch a Hugging Face mixture-of-experts model (this copy of it) from its ``eager``
    experts loop to ``grouped_mm``; a note saying so, or "" when nothing was switched.

    The eager loop runs each expert on the tokens routed to it (``torch.where`` on the routing:
    shapes that depend on data, which fake tensors cannot have). ``grouped_mm`` runs the same
    token-expert pairs as one matrix of tokens x top_k rows whatever the routing: balanced
    routing on average per expert, and the same rows in total as the loop (measured on the
    tiny example: the loop saves 6% more, its per-expert index copies)."""
    config = getattr(model, "config", None)
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if config is None or not callable(can_set) or not can_set():
        return ""
    if getattr(config, "_experts_implementation", None) != "eager":
        return ""
    try:
        model.set_experts_implementation("grouped_mm")
    except (ValueError, ImportError, RuntimeError):
        return ""
    return (
        "the experts' eager loop has data-dependent shapes; profiled with grouped_mm, for "
        "balanced routing (tokens x top_k expert rows)"
    )


# ---------------------------------------------------------------------------------------------
# A model on fake tensors, its repeated blocks left on meta
# ---------------------------------------------------------------------------------------------


@dataclass
class FakeModel:
    """A copy of a meta model ready for one forward under :attr:`mode` (see :func:`fake_model`)."""

    model: nn.Module
    mode: FakeTensorMode
    batch: Any  # the sample batch, on the CPU (fake once the mode runs)
    dtype: torch.dtype  # of the floating parameters and buffers
    blocks: list[nn.Module]  # the blocks, in module order
    signatures: dict[int, tuple[Any, ...]]  # id(block) -> block_signature(block)
    repeats: set[int] = field(default_factory=set)  # ids of blocks left on meta
    nested: set[int] = field(default_factory=set)  # ids of blocks that hold blocks
    note: str = ""  # what was changed to run it (experts_for_fake_tensors)
    held: list[torch.Tensor] = field(default_factory=list)  # the batch's fakes (convert_afresh)

    def materialize(self, block: nn.Module) -> bool:
        """Give a repeated block, met with an input no earlier one had, fake parameters; False
        when it has them already or is no repeat. Call under :attr:`mode`."""
        # Only a repeat: the meta tensors of a block holding blocks are its inner repeats', and
        # making its own anew would free storages the count has taken as parameters.
        if id(block) not in self.repeats or not any(p.is_meta for p in block.parameters()):
            return False
        materialize(block, self.dtype, recurse=True)
        return True


def fake_model(
    meta_model: nn.Module,
    block_classes: Iterable[str],
    batch: Any,
    dtype: torch.dtype = torch.float32,
) -> FakeModel:
    """A copy of ``meta_model`` (free on meta) whose parameters and buffers are fake CPU tensors
    of ``dtype`` (floating ones; what FSDP's param_dtype casts them to), except the blocks that
    repeat an earlier block's signature, which stay on meta until one has to run.

    Fake CPU tensors, not meta ones: on meta, SDPA takes the math path and saves the seq x seq
    attention matrix; fake CPU tensors dispatch to the flash kernel, as on a GPU."""
    from autoshard.sharding import wrap_classes_of
    from autoshard.target.step import move_to

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = module_copy(meta_model)
    note = experts_for_fake_tensors(model)
    block_types = tuple(wrap_classes_of(model, block_classes))
    blocks = [m for m in model.modules() if block_types and isinstance(m, block_types)]
    # Taken before materialising, which changes the dtypes of some blocks only.
    signatures = {id(block): block_signature(block) for block in blocks}
    nested = {
        id(block)
        for block in blocks
        if any(isinstance(m, block_types) for m in block.modules() if m is not block)
    }
    first_of: set[tuple[Any, ...]] = set()
    repeats: set[int] = set()
    for block in blocks:
        # a block holding blocks always runs: skipped, its inner blocks would not be met
        if signatures[id(block)] in first_of and id(block) not in nested:
            repeats.add(id(block))
        first_of.add(signatures[id(block)])
    in_repeats = {id(m) for b in blocks if id(b) in repeats for m in b.modules()}
    with mode:
        for module in model.modules():
            if id(module) not in in_repeats:
                materialize(module, dtype, recurse=False)
        held = convert_afresh(mode, batch)
        batch = move_to(batch, torch.device("cpu"))
    return FakeModel(model, mode, batch, dtype, blocks, signatures, repeats, nested, note, held)


# What a module's state holds that copy.deepcopy returns as it is, and the empty containers it
# makes anew: most of a module's state (its flags and eleven empty hook dicts).
_ATOMIC = (type(None), bool, int, float, str)
_EMPTY = (dict, OrderedDict, set, list)
_MODULE_COPYING = ("__deepcopy__", "__copy__", "__reduce_ex__", "__reduce__", "__getstate__",
                   "__setstate__")  # fmt: skip


def module_copy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, a quarter of its time on a module tree: what deepcopy makes of
    each module (a new module, its state copied, shared objects shared once), the modules walked
    here and their flags and empty hook dicts taken without deepcopy's dispatch (a 70B model's
    805 modules: 12 ms instead of 44, three times an estimate). Every parameter and buffer is a
    new tensor, as deepcopy's: materialising may swap the copy's parameter objects in place
    (``torch.__future__``'s swap on conversion), which must not reach ``model``. A module class
    that copies or pickles itself its own way is deep-copied as it asks."""
    return _copied(model, {})


def _copied(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    cls = type(module)
    if any(getattr(cls, n, None) is not getattr(nn.Module, n, None) for n in _MODULE_COPYING):
        return copy.deepcopy(module, memo)
    new = memo[id(module)] = cls.__new__(cls)
    state = module.__getstate__()
    for key, value in state.items():
        kind = type(value)
        if kind in _ATOMIC:
            continue
        if kind in _EMPTY and not value:
            state[key] = memo.setdefault(id(value), kind())  # shared once, as deepcopy does
        elif key == "_modules":
            state[key] = {k: None if m is None else _copied(m, memo) for k, m in value.items()}
        else:
            state[key] = copy.deepcopy(value, memo)
    new.__setstate__(state)
    return new


def sample_batch(model: nn.Module, batch: Any, seq_len: int | None, who: str) -> Any:
    """The first sample of ``batch``, or one sequence of ``seq_len`` token ids when there is no
    batch; ``who`` (the caller) is named when ``model`` is not on meta."""
    from autoshard.target.step import find_vocab_size

    if any(not p.is_meta for p in model.parameters()):
        raise ValueError(f"{who} needs a model built on the meta device")
    if batch is not None:
        return first_sample(batch)
    if find_vocab_size(model) is None or seq_len is None:
        raise ValueError("no example batch and no sequence length")
    return torch.zeros(1, seq_len, dtype=torch.long)


def materialize(module: nn.Module, dtype: torch.dtype, *, recurse: bool) -> None:
    """Fake CPU tensors for ``module``'s meta parameters and buffers, floating ones in ``dtype``.
    Call under the fake mode."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        kind = dtype if t.is_floating_point() else t.dtype
        if t.is_contiguous():  # what empty_like makes, without converting t (without_dynamo)
            return torch.empty_strided(t.shape, t.stride(), dtype=kind, device="cpu")
        return torch.empty_like(t, device="cpu", dtype=kind)

    module._apply(empty, recurse=recurse)


def block_signature(module: nn.Module) -> tuple[Any, ...]:
    """Blocks with the same class and the same parameter and buffer shapes do the same work and
    save the same bytes for the same input: one is run, the others reuse its count."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple((n, tuple(t.shape), t.dtype) for n, t in tensors))


def call_shapes(value: Any) -> Any:
    """A hashable description of a block's call arguments (tensors by shape and dtype)."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.requires_grad)
    if isinstance(value, dict):
        return tuple(
            (k, call_shapes(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
        )
    if isinstance(value, list | tuple):
        return tuple(call_shapes(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return type(value).__name__
    return value


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from tensors_in(v)


def convert_afresh(mode: FakeTensorMode, batch: Any) -> list[torch.Tensor]:
    """Give the fake mode its fake tensor for each tensor of ``batch`` (real or meta) that it
    keeps no value of, made afresh as the mode's converter would make it: the same shape,
    strides, dtype, device and storage size; the fake tensors, which the caller must hold (the
    mode remembers them weakly). Call under the mode.

    The batch itself stays as it is, as the mode converts it on first use; only torch's converter
    is not run, which loads ``torch._dynamo`` (:func:`without_dynamo`). Left to it: a tensor of
    one element (the mode keeps its value), one that needs a gradient, a subclass, one sharing
    its storage with another of the batch, or a view into a larger storage."""
    tensors = list(dict.fromkeys(tensors_in(batch)))  # in order, each object once
    storages = [t.untyped_storage()._cdata for t in tensors if not isinstance(t, FakeTensor)]
    converter = mode.fake_tensor_converter
    made: list[torch.Tensor] = []
    for t in tensors:
        if (
            type(t) is not torch.Tensor
            or t.device.type not in ("cpu", "meta")
            or t.numel() <= 1
            or t.requires_grad
            or storages.count(t.untyped_storage()._cdata) > 1
            or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()
            or not t.is_contiguous()
        ):
            continue
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        assert isinstance(fake, FakeTensor), "convert_afresh runs under its fake mode"
        converter.set_tensor_memo(t, fake)
        made.append(fake)
    return made


def fresh_like(value: Any) -> Any:
    """New fake tensors of the same shapes (no autograd history: nothing is saved twice)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value).requires_grad_(value.requires_grad)
    if isinstance(value, dict):
        return type(value)({k: fresh_like(v) for k, v in value.items()})
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(fresh_like(v) for v in value)
    return value


def first_sample(batch: Any) -> Any:
    """``batch`` cut to its first sample (every tensor's leading dimension), in tensors of
    their own: a slice's storage is the whole batch's, which a saved input would count."""
    if isinstance(batch, torch.Tensor):
        return batch[:1].clone() if batch.dim() else batch
    if isinstance(batch, dict):
        return {k: first_sample(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(first_sample(v) for v in batch)
    return batch
