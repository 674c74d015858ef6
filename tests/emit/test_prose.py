"""The prose every output shares (autoshard/emit/prose.py): each FSDP2 reshard policy in words, what
a choice rests on, which state dict to save, and the optimizer to build where a stack's config
has no key for it."""

from __future__ import annotations

from typing import Any

from autoshard.config import Engine, Sharding
from autoshard.emit.prose import (
    Stack,
    choose_state_dict_type,
    comment,
    describe_evidence,
    optimizer_note,
)
from tests.test_emit import HARDWARE, PROFILE, GiB, candidate, make_rec


def test_each_fsdp2_reshard_policy_is_described_word_for_word() -> None:
    from autoshard.config import Reshard
    from autoshard.emit.prose import describe_reshard

    def said(**update: Any) -> str:
        return describe_reshard(candidate(engine=Engine.FSDP2, **update))

    assert said(reshard=Reshard.ALL) == (
        "reshard policy all: every unit reshards after forward (reshard_after_forward=True, root "
        "included)"
    )
    assert said(reshard=Reshard.KEEP_ROOT) == (
        "reshard policy keep_root: the root stays gathered after forward (reshard_after_forward="
        "False on the root, True on the blocks: fully_shard's default)"
    )
    assert said(reshard=Reshard.KEEP_ROOT_AND_LAST) == (
        "reshard policy keep_root_and_last: the root and the last block stay gathered after "
        "forward (reshard_after_forward=False on them, True on the other blocks: torchtitan's)"
    )
    assert said(sharding=Sharding.SHARD_GRAD_OP) == (
        "nothing reshards after forward (SHARD_GRAD_OP: reshard_after_forward=False)"
    )
    assert describe_reshard(candidate()) == ""


def test_a_full_state_dict_up_to_8_gib_of_fp32_weights_or_a_quarter_of_the_host() -> None:
    def chosen(params: int, host: int | None = None) -> tuple[str, str]:
        hardware = HARDWARE.model_copy(update={"host_memory": host})
        profile = PROFILE.model_copy(update={"total_params": params})
        return choose_state_dict_type(make_rec(profile=profile, hardware=hardware))

    assert chosen(2 * GiB)[0] == "full"  # 8 GiB of fp32 weights: the limit itself
    kind, why = chosen(2 * GiB + 1)
    assert kind == "sharded" and "gather 8 GiB of fp32 weights" in why
    assert chosen(GiB, host=16 * GiB)[0] == "full"  # 4 GiB: a quarter of the host
    assert chosen(GiB + 1, host=16 * GiB)[0] == "sharded"
    kind, why = chosen(1000)
    assert kind == "full" and why.startswith("state_dict_type=full: the model's 3.91 KiB")


def test_the_evidence_says_measured_or_estimate_alone_and_comments_are_yaml_comments() -> None:
    measured = describe_evidence(make_rec())
    assert measured[2].startswith("measured ") and " on 2 cpu ranks: 0.228 s/step" in measured[2]
    assert measured[3].startswith("predicted peak ") and "(analytic)" in measured[3]
    estimated = describe_evidence(make_rec(basis="estimate"))
    assert "by estimate alone (not measured)" in estimated[2]
    assert comment(["a", "b"]) == "# a\n# b\n"


def test_the_optimizer_to_build_is_said_only_where_it_is_not_adamws_default() -> None:
    assert optimizer_note(candidate(), Stack.LIGHTNING) is None
    sgd = candidate(optimizer="sgd")
    assert optimizer_note(sgd, Stack.ACCELERATE) == (
        "optimizer: torch.optim.SGD(momentum=0.9, foreach=True), as the trials built it; the "
        "script, before accelerator.prepare builds it"
    )
