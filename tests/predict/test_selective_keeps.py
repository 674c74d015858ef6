"""What selective checkpointing keeps of each block's forward (predict/selective_keeps.py),
counted on the profile's fake forward, against what applying the policy keeps in a real forward
and adds in its recompute. Moved from tests/test_selective.py, whose models these are."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoshard import WorkloadSpec, profile_activations
from autoshard.sharding import apply_checkpointing

from ..test_selective import (
    HEADS,
    TOKENS,
    WIDTH,
    Model,
    ProjectedModel,
    _candidate,
    _profile,
)


class _LiveStorages(TorchDispatchMode):
    """Every new storage an operation makes inside a block, by block, as weak references."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.block: int | None = None
        self.made: dict[int, list[tuple[StorageWeakRef, int]]] = {0: [], 1: []}
        self.outputs: list[Any] = []
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda *_, i=i: setattr(self, "block", i))
            block.register_forward_hook(lambda *_, i=i: setattr(self, "block", None))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.block is not None:
            given = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                     if isinstance(t, torch.Tensor)}  # fmt: skip
            for t in tree_flatten(out)[0]:
                # new storages only: not views of the inputs or of the parameters
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in given:
                    storage = t.untyped_storage()
                    self.made[self.block].append((StorageWeakRef(storage), storage.nbytes()))
        return out

    def alive(self, block: int, but: torch.Tensor) -> int:
        """Bytes of the block's storages still alive, the block's output ``but`` left out."""
        seen: dict[int, int] = {}
        for ref, nbytes in self.made[block]:
            if not ref.expired() and ref.cdata != but.untyped_storage()._cdata:
                seen[ref.cdata] = nbytes
        return sum(seen.values())


def test_profile_counts_what_a_real_selective_forward_keeps() -> None:
    """After a real forward under torch's selective checkpointing (as trials apply it), the
    storages made inside each block that are still alive (besides its output) are those the
    policy cached: the profile, counted on fake tensors, says the same bytes."""
    torch.manual_seed(0)
    model = Model()
    apply_checkpointing(model, _candidate("selective"))
    x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    outputs = []
    model.blocks[0].register_forward_hook(lambda _m, _a, out: outputs.append(out))
    model.blocks[1].register_forward_hook(lambda _m, _a, out: outputs.append(out))
    tracker = _LiveStorages(model)
    with tracker:
        y = model(x)
    real_kept = [tracker.alive(i, outputs[i]) for i in range(2)]
    y.sum().backward()  # the forward's cache replays: the policy is what torch ran
    assert x.grad is not None

    with torch.device("meta"):
        meta = Model()
    acts = profile_activations(
        meta, _profile(meta), WorkloadSpec(), batch=torch.randn(2, TOKENS, WIDTH)
    )
    assert acts.measured, acts.note
    kept = [s - i for s, i in zip(acts.selective_saved_bytes, acts.block_input_bytes, strict=True)]
    sample = TOKENS * WIDTH * 4
    assert kept == real_kept
    # kept: the projection's and the last product's outputs, attention's and its log-sum-exp
    assert kept[0] == 3 * sample + HEADS * TOKENS * 4
    # between checkpointing everything (the input) and nothing (all the block saves)
    assert all(i < s < b for i, s, b in zip(
        acts.block_input_bytes, acts.selective_saved_bytes, acts.block_bytes, strict=True))  # fmt: skip
    # the backward rebuilds what was not kept: of what the block saves, all but the products
    assert all(
        0 < r < b for r, b in zip(acts.selective_recomputed_bytes, acts.block_bytes, strict=True)
    )


class _LiveBytes(TorchDispatchMode):
    """The bytes of every storage an operation made that is still alive; :meth:`at_next` counts
    them before the next operation runs (once Python let go of what ended before it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        # the parameters counted from the start (a detached one is no new storage)
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {
            p.untyped_storage()._cdata: (StorageWeakRef(p.untyped_storage()), 0)
            for p in model.parameters()
        }
        self.waiting: list[list[int]] = []

    def live(self) -> int:
        return sum(n for ref, n in self.refs.values() if not ref.expired())

    def at_next(self) -> list[int]:
        cell: list[int] = []
        self.waiting.append(cell)
        return cell

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for cell in self.waiting:
            cell.append(self.live())
        self.waiting = []
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                known = self.refs.get(storage._cdata)
                if known is None or known[0].expired():  # new, or an address used again
                    self.refs[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return out


def test_profile_counts_what_a_real_selective_recompute_adds() -> None:
    """In backward each block's recompute rebuilds what the policy did not keep, and lets go
    of the kept outputs it replays from the cache that nothing saved: the output projection
    here, which the old count kept beside what was rebuilt (0.25 MiB per block of the fp32 GPT
    at 512 tokens: the analytic estimate +5.3% against measured runs). The profile's recompute
    bytes, less the block's input (which stands in for the gradient arriving from above, as
    under full checkpointing), are what a real recompute adds, byte for byte."""
    torch.manual_seed(0)
    model = ProjectedModel()
    apply_checkpointing(model, _candidate("selective", block="ProjectedBlock"))
    tracker = _LiveBytes(model)
    calls: list[list[tuple[int, list[int]]]] = [[], []]  # per block: (bytes at start, at end)
    for block, made in zip(model.blocks, calls, strict=True):
        inner = block._checkpoint_wrapped_module

        def marked(*args: Any, inner: nn.Module = inner, made: list = made, **kw: Any) -> Any:
            start = tracker.live()
            try:
                return type(inner).forward(inner, *args, **kw)
            finally:  # its end; torch stops the recompute early, with an exception
                made.append((start, tracker.at_next()))

        inner.forward = marked
    with tracker:  # the input made inside: counted from the start too
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
        model(x).sum().backward()
    # each block ran twice: its forward, then its recompute in backward
    assert [len(made) for made in calls] == [2, 2]
    added = [end[0] - start for (_, _), (start, end) in calls]

    with torch.device("meta"):
        meta = ProjectedModel()
    acts = profile_activations(
        meta, _profile(meta, "ProjectedBlock"), WorkloadSpec(), batch=torch.randn(2, TOKENS, WIDTH)
    )
    assert acts.measured, acts.note
    counted = [r - i for r, i in zip(acts.selective_recomputed_bytes, acts.block_input_bytes,
                                     strict=True)]  # fmt: skip
    assert counted == added
    sample = TOKENS * WIDTH * 4
    # the norms' outputs and statistics, the second product, the residual, the MLP's two
    # widths (not the kept query, attention and log-sum-exp), less the output projection the
    # recompute replays from the cache and frees
    assert counted[1] == 2 * (sample + 2 * TOKENS * 4) + 2 * sample + 2 * 4 * sample - sample


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_counts_what_a_cuda_selective_forward_keeps() -> None:
    """The same on a GPU in bf16: CUDA's attention kernels keep a padded log-sum-exp and the
    dropout generator's state beside what the CPU fake forward counts (a few hundred bytes
    here), so within 15%, not to the byte."""
    torch.manual_seed(0)
    model = Model().cuda()
    apply_checkpointing(model, _candidate("selective"))
    x = torch.randn(1, TOKENS, WIDTH, device="cuda", requires_grad=True)
    outputs: list[torch.Tensor] = []
    for block in model.blocks:
        block.register_forward_hook(lambda _m, _a, out: outputs.append(out))
    tracker = _LiveStorages(model)
    with tracker, torch.autocast("cuda", dtype=torch.bfloat16):
        model(x)
    real_kept = [tracker.alive(i, outputs[i]) for i in range(2)]
    with torch.device("meta"):
        meta = Model()
    acts = profile_activations(meta, _profile(meta), WorkloadSpec(),
                               batch=torch.randn(1, TOKENS, WIDTH), precisions=("bf16-mixed",))  # fmt: skip
    kept = [s - i for s, i in zip(acts.selective_saved_bytes, acts.block_input_bytes, strict=True)]
    assert kept == pytest.approx(real_kept, rel=0.15)
