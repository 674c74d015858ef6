"""What the step's moments are made of (autoshard/predict/step_bytes.py), on a hand-made
activation profile whose bytes are worked out by hand: what each block keeps from its forward to
its backward under each checkpointing, the whole forward's saved bytes and the recompute
transient, the first and last blocks', and the conversion to the candidate's micro-batch and
precision. The same bytes in the step's events: tests/predict/test_step_memory.py."""

from __future__ import annotations

import pytest

from autoshard.config import Candidate, Precision
from autoshard.predict.activations import ActivationProfile
from autoshard.predict.step_bytes import (
    activation_bytes,
    after_blocks_bytes,
    block_saved_bytes,
    first_block_bytes,
    last_block_all_activations,
    last_block_bytes,
)

# per profiled sample, in fp32: three blocks, what each saves, its input, what the op-level
# policy keeps and recomputes, and what is saved outside the blocks
ACTS = ActivationProfile(
    precision="32-true",
    block_bytes=(100, 200, 300),
    block_input_bytes=(10, 20, 30),
    other_bytes=50,
    after_blocks_bytes=40,
    selective_saved_bytes=(60, 70, 80),
    selective_recomputed_bytes=(40, 130, 220),
    loss_bytes=5,
)


def candidate(checkpointing: str = "none", mbs: int = 2, **kw: object) -> Candidate:
    fields = {"precision": "32-true", **kw}
    return Candidate(wrap_classes=("m.Block",), checkpoint_classes=("m.Block",),
                     checkpointing=checkpointing, micro_batch_size=mbs, **fields)  # fmt: skip


@pytest.mark.parametrize(("checkpointing", "kept"), [
    ("none", (100, 200, 300)),  # all it saves
    ("all", (10, 20, 30)),  # its input
    ("selective", (60, 70, 80)),  # its input and what the policy saves
])  # fmt: skip
def test_what_a_block_keeps_to_its_backward_follows_its_checkpointing(checkpointing, kept) -> None:
    c = candidate(checkpointing)
    assert [block_saved_bytes(c, ACTS, i) for i in range(3)] == [2 * k for k in kept]
    assert block_saved_bytes(c, ACTS, 3) == block_saved_bytes(c, ACTS, -1) == 0  # no such block
    every2 = candidate("every_k", checkpoint_every=2)  # blocks 0 and 2 recompute
    assert [block_saved_bytes(every2, ACTS, i) for i in range(3)] == [20, 400, 60]


@pytest.mark.parametrize(("checkpointing", "saved", "recompute"), [
    ("none", (600 + 50) * 2 + 2 * 5, 0),
    ("all", (60 + 50) * 2 + 2 * 5, 300 * 2),  # one block rebuilt at a time: the largest
    ("selective", (210 + 50) * 2 + 2 * 5, 220 * 2),  # what the policy did not keep, at most
])  # fmt: skip
def test_the_forward_saves_the_blocks_and_the_rest_and_backward_rebuilds_one_block(
    checkpointing: str, saved: int, recompute: int
) -> None:
    assert activation_bytes(candidate(checkpointing), ACTS) == (saved, recompute)


def test_the_first_and_last_blocks_and_what_comes_after_them() -> None:
    plain, ckpt, sel = candidate(), candidate("all"), candidate("selective")
    # still saved at the first block's backward: its own and the embedding's (other_bytes)
    assert first_block_bytes(plain, ACTS) == (100 + 50) * 2
    assert first_block_bytes(ckpt, ACTS) == (10 + 50) * 2
    assert first_block_bytes(sel, ACTS) == (60 + 50) * 2
    assert (last_block_bytes(plain, ACTS), last_block_bytes(ckpt, ACTS)) == (600, 60)
    # everything the last block saves, whatever the checkpointing
    assert last_block_all_activations(ckpt, ACTS) == last_block_all_activations(plain, ACTS) == 600
    assert after_blocks_bytes(plain, ACTS) == 40 * 2
    # no blocks: what is saved outside them
    assert first_block_bytes(plain, ActivationProfile(other_bytes=7)) == 14


def test_a_profile_is_scaled_to_the_micro_batch_and_the_compute_element_size() -> None:
    # fp32 profile, a bf16 candidate: two bytes for every four profiled (no bf16 profile to use)
    bf16 = candidate(mbs=4, precision="bf16-mixed")
    assert block_saved_bytes(bf16, ACTS, 0) == 100 * 4 // 2
    assert activation_bytes(bf16, ACTS)[0] == (600 + 50) * 4 // 2 + 4 * 5  # the loss's: fp32
    # a profile taken at bf16 is used as it is
    at_bf16 = ACTS.model_copy(update={"precision": Precision.BF16_MIXED, "block_bytes": (1, 2, 3)})
    both = ACTS.model_copy(update={"others": (at_bf16,)})
    assert block_saved_bytes(bf16, both, 2) == 3 * 4
