"""A micro-batch's forward events (autoshard/predict/forward_events.py) under the loop's order:
Lightning's adds the last step's gradients to the end of forward and to the loss."""

from __future__ import annotations

from autoshard.config import Candidate, WorkloadSpec
from autoshard.predict.forward_events import forward_end
from autoshard.predict.step_bytes import step_bytes
from tests.test_loop import GLOO2

from .conftest import moments_of


def test_lightning_adds_the_last_steps_gradients_to_the_forward(tiny) -> None:
    profile, _ = tiny
    c = Candidate(wrap_classes=profile.wrap_policy, sharding="SHARD_GRAD_OP", precision="32-true")
    plain = moments_of(tiny, c, loop="plain")
    lightning = moments_of(tiny, c, loop="lightning")
    grads = profile.total_params * 4 // 2  # fp32, sharded over 2
    forward = forward_end(step_bytes(profile, c, GLOO2, WorkloadSpec(seq_len=64), tiny[1]))
    assert lightning["forward end, last step's gradients"].gradients == grads
    assert (
        lightning["forward end, last step's gradients"].total
        == forward["forward end"].total + grads
    )
    assert all("last step" not in name for name in plain)
    # SHARD_GRAD_OP holds every unit gathered at the end of forward: the peak moves there
    assert max(m.total for m in lightning.values()) > max(m.total for m in plain.values())
    # FSDP1 (use_orig_params=True) frees its flat gradients only at the root's pre-backward
    # hook: the loss is computed beside them too (measured: 6% low without this moment)
    assert lightning["loss, last step's gradients"].total == plain["loss"].total + grads
