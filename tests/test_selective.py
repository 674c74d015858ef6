"""Selective (op-level) activation checkpointing (issue 23): the policy, what applying it keeps
in a real forward against what the fake-tensor profile counts, its recompute FLOPs, the memory
and speed models' use of them, and the outputs that cannot express it saying so."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import SelectiveCheckpointContext

from autoshard import WorkloadSpec, analyze_model, profile_activations
from autoshard.config import Candidate, Checkpointing, Hardware
from autoshard.predict.flops import profile_flops
from autoshard.predict.step_bytes import activation_bytes, block_saved_bytes
from autoshard.sharding import apply_checkpointing, selective_policy

WIDTH, TOKENS, HEADS = 32, 16, 4
aten = torch.ops.aten


class Block(nn.Module):
    """Three products, an odd number (so that a policy not restarted per block call would keep
    others in the second block): a projection without bias (aten.mm, kept), attention by SDPA
    (kept), an MLP whose first Linear has a bias (aten.addmm, the second product: recomputed)
    and whose second has none (the third: kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.proj(x).view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
        attention = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        x = x + attention.transpose(1, 2).reshape(b, t, WIDTH)
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _profile(model: nn.Module) -> Any:
    path = f"{__name__}.Block"
    return analyze_model(model).model_copy(
        update={"checkpoint_policy": (path,), "wrap_policy": (path,), "block_count": 2}
    )


def _candidate(checkpointing: str, **update: Any) -> Candidate:
    path = f"{__name__}.Block"
    return Candidate(
        wrap_classes=(path,), checkpointing=checkpointing, precision="32-true",
        checkpoint_classes=(path,) if checkpointing != "none" else (), **update,
    )  # fmt: skip


def test_policy_saves_every_other_matmul_addmm_included_attention_and_restarts_per_call() -> None:
    from torch.utils.checkpoint import CheckpointPolicy as P

    forward = SelectiveCheckpointContext(is_recompute=False)
    policy = selective_policy()
    ops = [aten.addmm.default, aten.gelu.default, aten.mm.default, aten.mm.default,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.add.Tensor]  # fmt: skip
    assert [policy(forward, op) for op in ops] == [
        P.MUST_SAVE, P.PREFER_RECOMPUTE, P.PREFER_RECOMPUTE, P.MUST_SAVE, P.MUST_SAVE,
        P.PREFER_RECOMPUTE,
    ]  # fmt: skip
    # a fresh policy (the next checkpointed call) counts from the start again
    assert selective_policy()(forward, aten.mm.default) is P.MUST_SAVE


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


def test_memory_model_keeps_the_selective_bytes_between_none_and_all() -> None:
    with torch.device("meta"):
        meta = Model()
    acts = profile_activations(
        meta, _profile(meta), WorkloadSpec(), batch=torch.randn(1, TOKENS, WIDTH)
    )
    saved = {c: activation_bytes(_candidate(c, micro_batch_size=2), acts) for c in
             ("none", "selective", "all")}  # fmt: skip
    assert saved["all"][0] < saved["selective"][0] < saved["none"][0]
    # one block's recompute at a time: what selective did not keep, less than all's
    assert 0 < saved["selective"][1] < saved["all"][1]
    assert saved["selective"][1] == 2 * max(acts.selective_recomputed_bytes)
    c = _candidate("selective", micro_batch_size=2)
    assert block_saved_bytes(c, acts, 1) == 2 * acts.selective_saved_bytes[1]


def test_recompute_flops_are_the_products_the_policy_does_not_keep() -> None:
    with torch.device("meta"):
        meta = Model()
    flops = profile_flops(meta, _profile(meta), WorkloadSpec(), batch=torch.randn(1, TOKENS, WIDTH))
    assert flops.measured, flops.note
    up = 2 * TOKENS * WIDTH * 4 * WIDTH  # the second product: recomputed
    assert flops.block_selective_recompute == (up, up)
    assert flops.selective_recompute_flops == 2 * up
    assert flops.block_selective_recompute_attention == (0, 0)  # attention is kept
    # the element-wise work (GELU, additions) is recomputed: all its traffic, fewer kernels
    assert flops.block_selective_recompute_traffic == flops.block_forward_traffic
    assert all(0 < r < f for r, f in zip(
        flops.block_selective_recompute_ops, flops.block_forward_ops, strict=True))  # fmt: skip


def test_speed_model_times_the_selective_recompute_part_only() -> None:
    from autoshard.predict.speed import predict_speed

    with torch.device("meta"):
        meta = Model()
    profile = _profile(meta)
    flops = profile_flops(meta, profile, WorkloadSpec(), batch=torch.randn(1, TOKENS, WIDTH))
    hardware = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30, gpu="h100-sxm")
    workload = WorkloadSpec(seq_len=TOKENS)

    def recompute(c: str, f: Any = flops) -> float:
        return predict_speed(profile, f, _candidate(c), hardware, workload).breakdown.recompute_s

    assert recompute("none") == 0
    assert 0 < recompute("selective") < recompute("all")
    # a profile without the selective count (estimated FLOPs): the whole forward, as all
    unknown = flops.model_copy(update={"block_selective_recompute": ()})
    assert recompute("selective", unknown) == pytest.approx(recompute("all"))


def test_hugging_face_cache_is_turned_off_for_selective() -> None:
    """A forward that appends to a key/value cache recomputes other operations than it ran,
    which selective checkpointing refuses: applying it turns the cache off, as Hugging Face's
    own gradient checkpointing does."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    layer = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    candidate = Candidate(checkpointing="selective", checkpoint_classes=(layer,))
    apply_checkpointing(model, candidate)
    assert model.config.use_cache is False
    ids = torch.randint(0, 64, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()


def test_outputs_that_cannot_express_it_say_so_and_checkpoint_whole_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("lightning")
    from tests.test_emit import EXAMPLES, candidate, make_rec

    monkeypatch.syspath_prepend(str(EXAMPLES))
    rec = make_rec(candidate(checkpointing=Checkpointing.SELECTIVE))
    for fmt in ("accelerate", "lightning"):
        text = rec.to_yaml(fmt)
        assert "checkpoints whole blocks only" in text, fmt
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = rec.strategy()
    assert any("selective op-level" in str(w.message) for w in caught)
    assert strategy._activation_checkpointing_kwargs  # whole blocks: the closest it can
    # FSDP2: the plan applies it; nothing to say
    fsdp2 = make_rec(candidate(engine="fsdp2", checkpointing=Checkpointing.SELECTIVE))
    assert "checkpoints whole blocks only" not in fsdp2.to_yaml("lightning")


def test_dominance_orders_selective_between_none_and_all_but_not_against_every_k() -> None:
    """A measured run with less recompute makes one with more pointless: selective recomputes
    more than none and less than all, and neither more nor less than one block in k."""
    from autoshard.search import dominated_by
    from tests.test_emit import candidate, trial

    def ran(c: Candidate) -> Any:
        return trial(c, 0.2)

    none, selective = candidate(), candidate(checkpointing=Checkpointing.SELECTIVE)
    full = candidate(checkpointing=Checkpointing.ALL)
    every2 = candidate(checkpointing=Checkpointing.EVERY_K, checkpoint_every=2)
    assert dominated_by(selective, [ran(none)]) is not None
    assert dominated_by(full, [ran(selective)]) is not None
    assert dominated_by(none, [ran(selective)]) is None
    assert dominated_by(selective, [ran(every2)]) is None
    assert dominated_by(every2, [ran(selective)]) is None
