"""The dominance rules (autoshard.study.dominance): which measured trial makes trying a
candidate pointless, and which never does."""

from __future__ import annotations

import pytest

from autoshard.config import Engine
from autoshard.results import TrialResult, TrialStatus
from autoshard.study.dominance import dominated_by


def test_dominance_rules() -> None:
    from autoshard.config import Candidate

    fast = Candidate(precision="32-true")
    ckpt = fast.model_copy(update={"checkpointing": "all", "checkpoint_classes": ("x.B",)})
    ran = TrialResult(candidate=fast, status=TrialStatus.OK)
    assert dominated_by(ckpt, [ran]) is ran  # more recompute cannot be faster
    assert dominated_by(fast, [TrialResult(candidate=ckpt, status=TrialStatus.OK)]) is None
    oom = TrialResult(
        candidate=ckpt.model_copy(update={"micro_batch_size": 2}), status=TrialStatus.OOM
    )
    assert dominated_by(fast.model_copy(update={"micro_batch_size": 4}), [oom]) is oom
    assert dominated_by(fast.model_copy(update={"micro_batch_size": 1}), [oom]) is None
    other = fast.model_copy(
        update={"engine": Engine.FSDP2, "checkpointing": "all", "checkpoint_classes": ("x.B",)}
    )
    assert dominated_by(other, [ran]) is None


@pytest.mark.parametrize(
    "differs",
    [
        {"wrap_classes": ("x.B",)},  # per-block units against the whole model as one unit
        {"min_num_params": 100_000},
        {"optimizer_impl": "fused"},
        {"engine": "fsdp1"},
        {"reshard": "keep_root"},
        {"forward_prefetch": True},
        {"backward_prefetch": "BACKWARD_POST"},
        {"limit_all_gathers": False},
        {"reduce_dtype_fp32": False},
    ],
)
def test_dominance_never_skips_a_candidate_that_differs_elsewhere(differs) -> None:
    """A trial says nothing about a candidate that differs in a field no rule reasons about:
    the one-unit layout's run must not skip the per-block-wrapped candidates (and back)."""
    from autoshard.config import Candidate

    base = Candidate(engine="fsdp2", precision="bf16-mixed")  # FSDP1 always reduces in bf16
    ckpt = {"checkpointing": "all", "checkpoint_classes": ("x.B",)}
    other = Candidate.model_validate({**base.model_dump(), **differs})
    for ran, candidate in [(base, other), (other, base)]:
        more_recompute = Candidate.model_validate({**candidate.model_dump(), **ckpt})
        assert dominated_by(more_recompute, [TrialResult(candidate=ran, status="ok")]) is None
        bigger = candidate.model_copy(update={"micro_batch_size": 4})
        oom = Candidate.model_validate({**ran.model_dump(), **ckpt})
        assert dominated_by(bigger, [TrialResult(candidate=oom, status="oom")]) is None
    # ... while the same candidate with only checkpointing added is dominated, as before.
    same = Candidate.model_validate({**other.model_dump(), **ckpt})
    assert dominated_by(same, [TrialResult(candidate=other, status="ok")]) is not None


def test_dominance_compares_checkpointing_by_how_much_it_recomputes() -> None:
    from autoshard.config import Candidate

    every = {"checkpointing": "every_k", "checkpoint_classes": ("x.B",)}
    every2 = Candidate(**every, checkpoint_every=2)
    every3 = Candidate(**every, checkpoint_every=3)
    # every 3rd block recomputes less than every 2nd: the every-2nd run says nothing about it
    assert dominated_by(every3, [TrialResult(candidate=every2, status="ok")]) is None
    assert dominated_by(every2, [TrialResult(candidate=every3, status="ok")]) is not None
    # checkpointing of other classes is not comparable
    other_cls = Candidate(checkpointing="all", checkpoint_classes=("x.C",))
    assert dominated_by(other_cls, [TrialResult(candidate=every2, status="ok")]) is None
