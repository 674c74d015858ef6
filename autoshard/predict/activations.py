"""Activation profiles: what one forward saves for backward, counted on fake tensors.

Activations come from the model itself, not a rule of thumb: :func:`profile_activations` runs
one forward on fake CPU tensors (shapes only, no memory) under ``saved_tensors_hooks`` and counts
the bytes autograd saves for backward, inside each block and outside them, plus each block's
input (all that checkpointing keeps), at each precision the candidates use (a bf16 forward saves
fp32 copies where the model upcasts). Saved bytes are linear in batch x sequence with SDPA, so
one profile at micro-batch 1 scales to every micro-batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from autoshard.config import (
    Candidate,
    Precision,
    WorkloadSpec,
)
from autoshard.engine import element_bytes
from autoshard.predict.attention_kernels import AttentionAsOnCuda
from autoshard.predict.backward_peak import BackwardPeak, checkpointed_backward_peaks, first_calls
from autoshard.predict.dynamo_stand_in import without_dynamo
from autoshard.predict.fakes import (
    FakeModel,
    call_shapes,
    fake_forward_support,
    fake_model,
    fresh_like,
    sample_batch,
    tensors_in,
)
from autoshard.predict.forward_digest import ForwardDigest
from autoshard.predict.selective_keeps import SelectiveKeeps
from autoshard.results import ModelProfile
from autoshard.sharding import compute_dtype
from autoshard.target.step import forward


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
    after_blocks_bytes: int = Field(
        0,
        description="Of other_bytes, what was saved after the last block (the final norm's and "
        "the head's inputs), per sample: the head's backward frees it before any block's.",
    )
    selective_saved_bytes: tuple[int, ...] = Field(
        (),
        description="What each block keeps under selective (op-level) checkpointing, per sample: "
        "its input and the outputs of the operations the policy saves (autoshard.sharding."
        "selective_policy), counted on the same fake forward. Empty: not counted.",
    )
    selective_recomputed_bytes: tuple[int, ...] = Field(
        (),
        description="What each block's recompute adds in its backward under selective "
        "checkpointing, per sample: its saved activations (block_bytes) less the outputs the "
        "policy kept that the recompute replays from the cache (all made before the forward's "
        "last save). Its input, not rebuilt, is counted: it stands for the gradient arriving "
        "from the block above, as under full checkpointing (block_bytes).",
    )
    checkpointed_backward: tuple[int, int] = Field(
        (0, 0),
        description="A checkpointed block's backward at one sample: the most bytes it holds at "
        "once beyond its input (its recompute, the gradient arriving from above and the "
        "activations' gradients as they are made and freed), with and without its parameters' "
        "gradients made by then (which do not grow with the micro-batch); the block that saves "
        "the most, run on fake tensors (autoshard.predict.backward_peak). (0, 0): not measured.",
    )
    selective_backward: tuple[int, int] = Field(
        (0, 0),
        description="checkpointed_backward under selective (op-level) checkpointing: beyond "
        "what the block keeps (selective_saved_bytes).",
    )
    loss_bytes: int = Field(
        0, description="The loss's fp32 log-probabilities, per sample (fp32 at every precision)."
    )
    loss_in_forward: bool = Field(
        False,
        description="The model computes its loss in forward (a Hugging Face model given "
        "labels): the loss's saved tensors are counted in loss_bytes, not other_bytes.",
    )
    math_attention: bool = Field(
        False,
        description="Attention ran as torch's math kernel, as a CUDA GPU runs a call no fused "
        "kernel takes (fp32 with grouped-query heads: autoshard.predict.attention_kernels): it "
        "saved the softmax's probabilities, heads x queries x keys per sample. The same "
        "precision with fused attention is then among ``others`` (:meth:`fused_at`).",
    )
    measured: bool = Field(True, description="False when the fake forward failed (estimated).")
    forward_digest: str = Field(
        "", description="What the forward computes (autoshard.predict.forward_digest); '': unknown."
    )
    note: str = ""
    others: tuple[ActivationProfile, ...] = Field(
        (), description="The same model profiled at other precisions."
    )

    def at(self, precision: Precision | str) -> ActivationProfile:
        """The profile taken at ``precision`` (16-mixed saves what bf16-mixed does), or this one
        (with fused attention: another precision's attention runs no math kernel): :meth:`scale`
        then converts by element size only, which misses what a model keeps in fp32 under low
        precision (an RMSNorm's upcast: -10% on a 7B Llama shape, simulated)."""
        precision = Precision(precision)  # "bf16-mixed" finds the bf16 profile too
        wanted = Precision.BF16_MIXED if precision is Precision.FP16_MIXED else precision
        for acts in (self, *self.others):
            if acts.precision is wanted:
                return acts
        return next((a for a in (self, *self.others) if not a.math_attention), self)

    def fused_at(self, precision: Precision | str) -> ActivationProfile:
        """The profile at ``precision`` with fused attention: :meth:`at`'s, or where that ran
        the math kernel (``math_attention``), its fused twin. The fp32 one sizes activation
        gradients in every precision, and a 16-bit candidate's attention runs a fused kernel on
        the GPU: only an fp32 candidate's own profile carries the math kernel's probabilities."""
        at = self.at(precision)
        twins = (a for a in (self, *self.others) if a.precision is at.precision)
        return next((a for a in twins if not a.math_attention), at)

    def scale(self, candidate: Candidate) -> float:
        """Bytes per profiled byte for ``candidate``: its micro-batch times the ratio of its
        compute element size to the profile's."""
        return (
            candidate.micro_batch_size
            * element_bytes(candidate.precision)[1]
            / element_bytes(self.precision)[1]
        )


@contextlib.contextmanager
def _block_hooks(
    model: nn.Module,
    blocks: list[nn.Module],
    stack: list[int],
    finished: set[int],
    on_enter: Callable[[], None] = lambda: None,
) -> Iterator[list[int]]:
    """Keep ``stack`` (the blocks running) and ``finished`` (the blocks that ran) up to date
    through a forward, calling ``on_enter`` as a block starts; yields the blocks' input bytes,
    in call order."""
    inputs: list[int] = []
    handles = []
    for index, block in enumerate(blocks):

        def pre(_m: nn.Module, args: Any, index: int = index) -> None:
            stack.append(index)
            on_enter()
            first = args[0] if args else None
            if isinstance(first, torch.Tensor):
                inputs.append(first.numel() * first.element_size())

        def post(_m: nn.Module, _args: Any, _out: Any, index: int = index) -> None:
            stack.pop()
            finished.add(index)

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
    try:
        yield inputs
    finally:
        for h in handles:
            h.remove()


def profile_activations(
    model: nn.Module,
    profile: ModelProfile,
    workload: WorkloadSpec,
    batch: Any | None = None,
    *,
    precisions: Sequence[Precision | str] = (Precision.FP32,),
    attention_on: Literal["cpu", "cuda"] = "cpu",
) -> ActivationProfile:
    """Count what one forward at micro-batch 1 saves for backward, on fake tensors, at each of
    ``precisions`` (the first is returned, the others in its ``others``).

    ``attention_on``: the device whose attention kernels the step runs. ``"cuda"`` runs each
    attention as a CUDA GPU's kernel choice would (:mod:`autoshard.predict.attention_kernels`:
    fp32 with grouped-query heads runs the math kernel and saves its probabilities; the fp32
    profile with fused attention is kept too, see :meth:`ActivationProfile.fused_at`);
    ``"cpu"`` (CPU worker processes) as the CPU runs it.

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
        batch = sample_batch(model, batch, seq, "profile_activations")
        # 16-mixed saves what bf16-mixed does (2-byte compute, the same autocast lists)
        # Precision(p): a caller's "32-true" is the enum (a plain string profiled nothing and
        # fell back to the rule of thumb without a word)
        wanted = [Precision.BF16_MIXED if p is Precision.FP16_MIXED else p
                  for p in map(Precision, precisions)]  # fmt: skip
        profiles, failed = [], []
        for precision in dict.fromkeys(wanted):
            try:
                with fake_forward_support():
                    profiles.append(
                        without_dynamo(
                            _profile_once, model, profile, batch, precision, seq,
                            attention_on == "cuda",
                        )
                    )  # fmt: skip
            except Exception as exc:  # one precision failing leaves the others usable
                failed.append((precision, exc))
        if not profiles:
            raise failed[0][1]
        profiles += _fused_twins(model, profile, batch, seq, profiles)
        first, *others = profiles
        note = "; ".join(
            [first.note] * bool(first.note)
            + [
                f"the forward did not run on fake tensors at {p.value} ({type(e).__name__}: "
                f"{e}); its activations are scaled from {first.precision.value}".splitlines()[0]
                for p, e in failed
            ]
        )
        return first.model_copy(update={"others": tuple(others), "note": note})
    except Exception as exc:  # a model whose forward cannot run on meta: fall back, say so
        return rule_of_thumb(profile, workload, f"{type(exc).__name__}: {exc}".splitlines()[0])


def _fused_twins(
    model: nn.Module,
    profile: ModelProfile,
    batch: Any,
    seq: int | None,
    profiles: list[ActivationProfile],
) -> list[ActivationProfile]:
    """The fp32 profile with fused attention where fp32 ran the math kernel: what sizes the
    activation gradients of the other precisions (:meth:`ActivationProfile.fused_at`)."""
    if not any(a.math_attention and a.precision is Precision.FP32 for a in profiles):
        return []
    with fake_forward_support():
        return [without_dynamo(_profile_once, model, profile, batch, Precision.FP32, seq)]


def precisions_of(candidates: Sequence[Candidate]) -> tuple[Precision, ...]:
    """The precisions to profile for ``candidates``: theirs, and always fp32, which sizes the
    gradients of activations in every precision (see :func:`peak_moments`)."""
    return tuple(dict.fromkeys([*(c.precision for c in candidates), Precision.FP32]))


def _profile_once(
    meta_model: nn.Module,
    profile: ModelProfile,
    batch: Any,
    precision: Precision,
    seq: int | None,
    on_cuda: bool = False,
) -> ActivationProfile:
    dtype = compute_dtype(precision)
    fakes = fake_model(meta_model, profile.checkpoint_policy, batch, dtype)
    model, blocks = fakes.model, fakes.blocks
    stack: list[int] = []
    finished: set[int] = set()
    counts = _Counts(
        per_block=[0] * len(blocks),
        keeps=SelectiveKeeps(stack, len(blocks)),
        params={p.untyped_storage()._cdata for p in model.parameters() if not p.is_meta},
    )
    per_block, keeps, seen = counts.per_block, counts.keeps, counts.seen
    digest = ForwardDigest()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keeps.saving()  # every save, parameters' and repeated ones' included
        key = t.untyped_storage()._cdata
        if key in counts.params or key in seen:
            return t
        nbytes = seen[key] = t.untyped_storage().nbytes()
        if stack:
            per_block[stack[-1]] += nbytes
        else:
            counts.other += nbytes
            if blocks and len(finished) == len(blocks):
                # after the last block (the final norm, the head): backward frees it before it
                # reaches any block
                counts.after += nbytes
        return t

    autocast = (
        torch.autocast("cpu", dtype=dtype)
        if precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)
        else contextlib.nullcontext()
    )
    for index, block in enumerate(blocks):
        block.forward = _counting(index, block, fakes, counts)

    def on_enter() -> None:
        keeps.enter()
        digest.call(stack[-1])

    hooks = _block_hooks(model, blocks, stack, finished, on_enter)
    # attention as the GPU runs it, through the forward and the measured block backwards
    kernels = AttentionAsOnCuda() if on_cuda else None
    as_run = kernels or contextlib.nullcontext()
    with fakes.mode, hooks as inputs, autocast, as_run, first_calls(blocks) as calls:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), keeps, digest:
            out = forward(model, fakes.batch)
        loss = _loss_bytes(out)
        if loss[1]:
            # The model computed its loss in forward (a Hugging Face model given labels): what
            # the loss saved is counted outside the blocks already; it is the loss's.
            counts.other = max(0, counts.other - loss[0])
            counts.after = max(0, counts.after - loss[0])
    note = fakes.note
    try:  # one block's backward, run again with its first call's input
        with fakes.mode, autocast, kernels.replayed() if kernels else contextlib.nullcontext():
            peaks = checkpointed_backward_peaks(blocks, calls, per_block)
    except Exception as exc:  # the forward's counts stand; the backward's peak is estimated
        peaks = None
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        note = "; ".join([*[note] * bool(note), f"a checkpointed block's backward did not run "
                          f"on fake tensors ({why}): its peak is estimated"])  # fmt: skip
    ran_math = kernels is not None and kernels.math_calls > 0
    measured = {
        **_backward_fields(peaks), "math_attention": ran_math, "forward_digest": digest.hexdigest()
    }  # fmt: skip
    return _profile_of(seq, precision, counts, inputs[: len(blocks)], loss, note).model_copy(
        update=measured
    )


@dataclass
class _Counts:
    """One fake forward's tallies: bytes saved in each block, by none (``other``) and after the
    last (``after``); what selective checkpointing would keep; each saved storage's bytes,
    counted once (``seen``); the parameters' storages (never counted); and each repeated
    block's first call, by (signature, input shapes): (saved, kept, kept and saved, output)."""

    per_block: list[int]
    keeps: SelectiveKeeps
    params: set[int]
    seen: dict[int, int] = field(default_factory=dict)
    counted: dict[Any, tuple[int, int, int, Any]] = field(default_factory=dict)
    other: int = 0
    after: int = 0


def _counting(
    index: int, block: nn.Module, fakes: FakeModel, counts: _Counts
) -> Callable[..., Any]:
    """``block``'s forward for the profile: what it saves adds to ``counts.per_block[index]``
    (through the saved-tensors hook); a repeated block met again with the same signature and
    input shapes adds its first call's count from ``counts.counted`` and returns a fresh output
    unrun."""
    per_block, keeps, seen, counted = counts.per_block, counts.keeps, counts.seen, counts.counted
    original = block.forward
    signature = fakes.signatures[id(block)]

    def forward(*args: Any, **kwargs: Any) -> Any:
        key = (signature, call_shapes((args, kwargs)))
        if id(block) in fakes.repeats and key in counted:
            saved, kept, overlap, output = counted[key]
            per_block[index] += saved
            keeps.kept[index] += kept
            keeps.overlap[index] += overlap
            return fresh_like(output)
        if fakes.materialize(block):  # a repeat with a new input
            counts.params.update(p.untyped_storage()._cdata for p in block.parameters())
        before, seen_before = per_block[index], set(seen)
        kept_before, overlap_before = keeps.kept[index], keeps.overlap[index]
        output = original(*args, **kwargs)
        # What the block saved of the tensors every block is given (rotary tables, masks)
        # is saved once: a repeat would find it already counted.
        shared = {
            t.untyped_storage()._cdata
            for t in tensors_in((args[1:], kwargs))
            if t.untyped_storage()._cdata not in seen_before
        }
        own = per_block[index] - before - sum(seen.get(k, 0) for k in shared)
        kept = keeps.kept[index] - kept_before
        counted.setdefault(key, (own, kept, keeps.overlap[index] - overlap_before, output))
        return output

    forward.__wrapped__ = original  # type: ignore[attr-defined]  # the block's own, to run it again
    return forward


def _backward_fields(peaks: tuple[BackwardPeak, BackwardPeak] | None) -> dict[str, Any]:
    """The profile's fields of a checkpointed block's measured backward peaks (none: not
    measured)."""
    if peaks is None:
        return {}
    whole, selective = peaks
    return {
        "checkpointed_backward": (whole.total, whole.activations_only),
        "selective_backward": (selective.total, selective.activations_only),
    }


def _loss_bytes(out: Any) -> tuple[int, bool]:
    """(bytes the loss saves, whether the model computed it in forward) for the forward's
    output ``out``: the log-probabilities of the logits, in fp32 even under autocast."""
    logits = getattr(out, "logits", out)
    if not (isinstance(logits, torch.Tensor) and logits.requires_grad):
        return 0, False
    return logits.numel() * 4, isinstance(getattr(out, "loss", None), torch.Tensor)


def _profile_of(
    seq: int | None,
    precision: Precision,
    counts: _Counts,
    inputs: list[int],
    loss: tuple[int, bool],
    note: str,
) -> ActivationProfile:
    """The profile of one fake forward's ``counts``; ``inputs``: each block's input bytes;
    ``loss``: the bytes the loss saves, and whether the model computed it in forward."""
    per_block, keeps = counts.per_block, counts.keeps
    block_inputs = tuple(inputs)
    blocks = len(per_block)
    return ActivationProfile(
        seq_len=seq,
        precision=precision,
        block_bytes=tuple(per_block),
        block_input_bytes=block_inputs,
        selective_saved_bytes=tuple(
            (block_inputs[i] if i < len(block_inputs) else 0) + keeps.kept[i] for i in range(blocks)
        ),
        selective_recomputed_bytes=tuple(
            max(0, b - o) for b, o in zip(per_block, keeps.overlap, strict=True)
        ),
        other_bytes=counts.other,
        after_blocks_bytes=counts.after,
        loss_bytes=loss[0],
        loss_in_forward=loss[1],
        note=note,
    )


def rule_of_thumb(profile: ModelProfile, workload: WorkloadSpec, why: str) -> ActivationProfile:
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
