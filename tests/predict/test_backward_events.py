"""The rules of a micro-batch's backward events (autoshard/predict/backward_events.py), one at a
time on the tiny GPT's step bytes: the names a block's backward event goes by, the root
re-gathered when backward starts (FSDP2 only, and only where it is sharded), the head's backward
and the optimizer step. The events walked in the step's order: tests/predict/test_step_memory.py."""

from __future__ import annotations

import pytest

from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.predict.backward_events import (
    backward_start,
    block_event_names,
    head_backward,
    optimizer_step,
)
from autoshard.predict.step_bytes import step_bytes

TWO = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30)
ONE = Hardware(gpus_per_node=1, gpu_memory=80 * 2**30)


def test_a_blocks_backward_is_named_by_its_place_from_the_top_and_the_bottom() -> None:
    assert [block_event_names(i, 6) for i in reversed(range(6))] == [
        ("top block backward",),
        ("second block backward",),
        ("block 3 backward",),
        ("block 2 backward",),
        ("block above the bottom backward",),
        ("bottom block backward",),
    ]
    # three blocks: the second from the top is the one above the bottom, named once
    assert block_event_names(1, 3) == ("second block backward",)
    # two blocks: the bottom one is also the second; one block is top and bottom
    assert block_event_names(0, 2) == ("second block backward", "bottom block backward")
    assert block_event_names(0, 1) == ("top block backward", "bottom block backward")


@pytest.mark.parametrize(("engine", "hardware", "regathered"), [
    ("fsdp2", TWO, True), ("fsdp2", ONE, False), ("fsdp1", TWO, False),
])  # fmt: skip
def test_only_fsdp2_regathers_a_sharded_root_when_backward_starts(
    tiny, engine: str, hardware: Hardware, regathered: bool
) -> None:
    profile, acts = tiny
    c = Candidate(engine=engine, wrap_classes=profile.wrap_policy, precision="bf16-mixed")
    t = step_bytes(profile, c, hardware, WorkloadSpec(seq_len=64), acts)
    head = head_backward(t)
    start = backward_start(t, head)
    if not regathered:
        assert start is None
        return
    assert start is not None
    root = t.root_params * 2  # bf16: the all-gather buffer beside its copy
    assert root > 0 and start.unsharded_params == start.comm_buffers == root
    assert start.temporaries == head.temporaries // 2  # the logits' gradient back in bf16
    assert start.activations == head.activations and start.optimizer == head.optimizer


def test_the_heads_backward_holds_the_logits_gradient_and_not_the_losss_log_probabilities(
    tiny,
) -> None:
    profile, acts = tiny
    c = Candidate(wrap_classes=profile.wrap_policy, precision="32-true")
    t = step_bytes(profile, c, TWO, WorkloadSpec(seq_len=64), acts)
    head = head_backward(t)
    assert t.loss_saved_bytes > 0 and t.logits_grad_bytes > 0
    assert head.activations == t.saved_bytes - t.loss_saved_bytes
    assert head.temporaries == t.logits_grad_bytes
    assert head.gradients == 0  # no block has made its gradients yet (and nothing offloaded)
    # no block has reduced yet: every block's reduce-scatter input is still to come
    assert head.comm_buffers == t.comm_bytes - t.trained_block_params * t.reduce_dtype_bytes


def test_the_optimizer_step_holds_the_gradients_and_states_but_no_activations(tiny) -> None:
    profile, acts = tiny
    c = Candidate(wrap_classes=profile.wrap_policy, precision="32-true")
    t = step_bytes(profile, c, TWO, WorkloadSpec(seq_len=64), acts)
    step = optimizer_step(t)
    assert step.activations == 0 and step.comm_buffers == 0
    # fp32, sharded over 2 ranks: a half of every gradient, two Adam states of the same size
    assert step.gradients == t.grad_shard_bytes == profile.total_params * 4 // 2
    assert step.optimizer == 2 * step.gradients
    assert step.temporaries == t.foreach_bytes > 0
