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


def _profile(model: nn.Module, block: str = "Block") -> Any:
    path = f"{__name__}.{block}"
    return analyze_model(model).model_copy(
        update={"checkpoint_policy": (path,), "wrap_policy": (path,), "block_count": 2}
    )


def _candidate(checkpointing: str, block: str = "Block", **update: Any) -> Candidate:
    path = f"{__name__}.{block}"
    return Candidate(
        wrap_classes=(path,), checkpointing=checkpointing, precision="32-true",
        checkpoint_classes=(path,) if checkpointing != "none" else (), **update,
    )  # fmt: skip


class ProjectedBlock(nn.Module):
    """A GPT block's order: attention's output projection (the third product: kept) feeds only
    the residual add, and a norm saves after it, so the recompute replays it from the cache and
    frees it; the MLP's last product (the fifth: kept) comes after the block's last save, so the
    recompute stops before it and it stays cached."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.kv = nn.Linear(WIDTH, WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
        k = self.kv(h).view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
        attention = F.scaled_dot_product_attention(q, k, k, is_causal=True)
        x = x + self.out(attention.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ProjectedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ProjectedBlock(), ProjectedBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


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


def test_hugging_face_cache_is_off_under_whole_block_checkpointing_too() -> None:
    """Under whole-block checkpointing the cache would keep every layer's keys and values alive
    beside the checkpointed blocks (the estimates count without it): it is turned off there
    too, and the forward hands back no cache; without checkpointing it is left as it is."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    layer = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    untouched = LlamaForCausalLM(config)
    apply_checkpointing(untouched, Candidate())
    assert untouched.config.use_cache is True
    model = LlamaForCausalLM(config)
    apply_checkpointing(model, Candidate(checkpointing="all", checkpoint_classes=(layer,)))
    ids = torch.randint(0, 64, (1, 8))
    assert model(input_ids=ids, labels=ids).past_key_values is None


def test_outputs_that_checkpoint_an_hf_model_say_to_turn_its_cache_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """accelerate, the HF Trainer and Lightning's FSDPStrategy apply FSDP's checkpointing, which
    leaves the cache on: each output says to turn it off, as the plan assumed; a model without
    Hugging Face classes, or no checkpointing, gets no such line."""
    pytest.importorskip("lightning")
    from autoshard.results import ClassStat
    from tests.test_emit import EXAMPLES, PROFILE, candidate, make_rec

    monkeypatch.syspath_prepend(str(EXAMPLES))
    hf = PROFILE.model_copy(update={"classes": (ClassStat(
        class_path="transformers.models.llama.modeling_llama.LlamaDecoderLayer",
        name="LlamaDecoderLayer", count=2, params_each=1000, params_total=2000,
        share=0.5),)})  # fmt: skip
    ckpt = candidate(checkpointing=Checkpointing.ALL)
    for fmt in ("accelerate", "hf-trainer", "lightning"):
        assert "use_cache = False" in make_rec(ckpt, profile=hf).to_yaml(fmt), fmt
        assert "use_cache" not in make_rec(ckpt).to_yaml(fmt), fmt
        assert "use_cache" not in make_rec(candidate(), profile=hf).to_yaml(fmt), fmt
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_rec(ckpt, profile=hf).strategy()
    assert any("use_cache = False" in str(w.message) for w in caught)


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


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes autograd saves in one forward, each storage once, the parameters left out."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in params:
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


def test_a_hugging_face_forward_without_cache_saves_on_fake_tensors_what_it_saves_on_real_ones() -> (
    None
):
    """Without a key/value cache (selective checkpointing turns it off) Hugging Face asks
    whether the position ids pack several sequences per row: real ones are read (one sequence:
    SDPA with is_causal), fake ones cannot be, and were taken as packed: a seq x seq mask, keys
    and values copied per head (grouped-query attention) and a float mask saved per layer, which
    made the simulation of a selective Llama 6.7% high against measured runs at fp32."""
    pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import LlamaConfig, LlamaForCausalLM

    from autoshard.predict.fakes import fake_forward_support

    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                         use_cache=False)  # fmt: skip
    real = _saved_bytes(LlamaForCausalLM(config), torch.randint(0, 64, (1, 64)))
    with fake_forward_support(), FakeTensorMode(allow_non_fake_inputs=True):
        fake = _saved_bytes(LlamaForCausalLM(config), torch.randint(0, 64, (1, 64)))
    assert fake == real


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
    from autoshard.study.dominance import dominated_by
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
