"""The reasons a decision gives (autoshard.reasons): a setting in which another candidate differs,
in the engine's own terms, and what an offloading choice needs of the host. The reasons of a whole
decision are tests/test_decide.py's."""

from __future__ import annotations

from autoshard.config import Candidate, Hardware
from autoshard.reasons import differences, host_memory_reason
from autoshard.results import Scored
from autoshard.units import format_bytes
from tests.test_emit import estimate

GIB = 2**30


def test_a_wrap_difference_is_said_in_the_engines_own_terms() -> None:
    blocks = Candidate(wrap_classes=("gpt.Block", "gpt.Head"))
    assert differences(Candidate(), blocks) == ["auto_wrap_policy=Block,Head"]
    assert differences(blocks, Candidate()) == ["auto_wrap_policy=none (one unit)"]
    assert differences(Candidate(), Candidate(min_num_params=10_000)) == [
        "auto_wrap_policy=size>=10,000"
    ]
    fsdp2 = Candidate(engine="fsdp2", wrap_classes=("gpt.Block",))
    assert "fully_shard units=Block" in differences(Candidate(engine="fsdp2"), fsdp2)
    every2 = Candidate(checkpointing="every_k", checkpoint_every=2, checkpoint_classes=("a.B",))
    assert differences(Candidate(), every2) == ["checkpointing=every 2 blocks"]


def test_an_offloading_choice_says_what_it_needs_of_the_host() -> None:
    offload = estimate(Candidate(cpu_offload=True, wrap_classes=("gpt.Block",)))
    need = format_bytes(offload.host_peak)
    hardware = Hardware(gpus_per_node=2, gpu_memory=2 * GIB)
    chosen = Scored(candidate=offload.candidate, estimate=offload)
    assert host_memory_reason(chosen, hardware) == [
        f"CPU offload needs {need} of host memory per node (parameters, gradients and "
        "optimizer states of the node's ranks): not checked, no host memory given"
    ]
    with_host = hardware.model_copy(update={"host_memory": 64 * GIB})
    assert host_memory_reason(chosen, with_host) == [
        f"CPU offload needs {need} of host memory per node (parameters, gradients and optimizer "
        "states of the node's ranks), of 64 GiB"
    ]
    kept = estimate(Candidate(wrap_classes=("gpt.Block",)))
    assert host_memory_reason(Scored(candidate=kept.candidate, estimate=kept),
                                            with_host) == []  # fmt: skip
