"""The step's memory events (autoshard/predict/step_memory.py): the events in the order the step
runs them, the peak the largest of them, the walk's state (which gradients a micro-batch's turns
run beside), and the turn of the timeline each event happens in."""

from __future__ import annotations

import itertools

import pytest

from autoshard.analyze import analyze_target
from autoshard.config import Candidate, Engine, Hardware, Reshard, WorkloadSpec
from autoshard.predict.activations import ActivationProfile, profile_activations
from autoshard.predict.backward_events import block_event_names
from autoshard.predict.step_bytes import block_saved_bytes, step_bytes
from autoshard.predict.step_memory import MemoryEvent, peak_event, step_events
from autoshard.predict.timeline import step_timeline
from autoshard.results import MemoryBreakdown, ModelProfile
from autoshard.target.resolve import TargetSpec

from ..conftest import EXAMPLES

GIB = 2**30
TWO = Hardware(gpus_per_node=2, gpu_memory=80 * GIB)

SIX = TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny", "n_layer": 6})


@pytest.fixture(scope="module")
def six_blocks() -> tuple[ModelProfile, ActivationProfile]:
    profile, built = analyze_target(SIX)
    workload = WorkloadSpec(seq_len=128, loop="plain")
    return profile, profile_activations(built.model, profile, workload, precisions=["32-true"])


def fsdp2_every_2nd(profile: ModelProfile) -> Candidate:
    return Candidate(
        engine="fsdp2", wrap_classes=profile.wrap_policy, checkpointing="every_k",
        checkpoint_every=2, checkpoint_classes=profile.wrap_policy, micro_batch_size=4,
        precision="32-true",
    )  # fmt: skip


def test_memory_events_run_in_the_order_of_the_step(six_blocks) -> None:
    profile, acts = six_blocks
    plain = WorkloadSpec(seq_len=128, loop="plain")
    events, _ = step_events(profile, fsdp2_every_2nd(profile), TWO, plain, acts)
    assert [e.name for e in events] == [
        "forward start", "last block all-gather", "last block forward", "root forward end",
        "loss", "backward start", "head backward", "top block backward",
        "second block backward", "block 3 backward", "block 2 backward",
        "block above the bottom backward", "bottom block backward", "root backward",
        "optimizer step",
    ]  # fmt: skip
    lightning = WorkloadSpec(seq_len=128, loop="lightning", accumulate=2)
    names = [
        e.name for e in step_events(profile, fsdp2_every_2nd(profile), TWO, lightning, acts)[0]
    ]
    # the later micro-batch beside the first's gradients, then the step, then the next forward
    assert names.index("bottom block backward") < names.index("accumulating forward start")
    assert names.index("accumulating root backward") < names.index("optimizer step")
    assert names[-1] == "forward end, last step's gradients"  # FSDP2 frees them at backward
    assert names.index("optimizer step") < names.index("forward start, last step's gradients")


def test_the_peak_is_the_event_with_the_most_live_bytes_the_earliest_of_equals() -> None:
    def event(name: str, activations: int) -> MemoryEvent:
        return MemoryEvent(name, MemoryBreakdown(activations=activations))

    events = [event("loss", 5), event("head backward", 7), event("root backward", 7)]
    assert peak_event(events).name == "head backward"


@pytest.mark.parametrize("engine", [Engine.FSDP1, Engine.FSDP2])
def test_each_block_backward_frees_what_the_block_above_saved(six_blocks, engine) -> None:
    """Resharding, every 2nd of 6 blocks checkpointed: walking down the blocks, each block's
    backward frees what the block above saved, has the temporaries of its own checkpointing,
    and holds one more block's gradient shard. FSDP2 holds the block above's reduce-scatter
    input beside the next block's all-gather buffer (none at the top, none to prefetch at the
    bottom); FSDP1 gathers into the flat parameters (no buffers), and the block just above's
    flat gradient is not yet reduced (the top two hold none)."""
    profile, acts = six_blocks
    candidate = fsdp2_every_2nd(profile).model_copy(update={"engine": engine})
    plain = WorkloadSpec(seq_len=128, loop="plain")
    t = step_bytes(profile, candidate, TWO, plain, acts)
    moments = {e.name: e.live for e in step_events(profile, candidate, TWO, plain, acts)[0]}
    walk = [moments[block_event_names(i, 6)[0]] for i in reversed(range(6))]
    shard = t.block_grad_shard_bytes // 6
    reduce_input = t.trained_block_params * t.reduce_dtype_bytes
    for above, (upper, lower) in enumerate(itertools.pairwise(walk)):
        index = 4 - above  # the lower block's
        grown = 0 if engine is Engine.FSDP1 and above == 0 else shard
        assert lower.gradients - upper.gradients == grown
        assert upper.activations - lower.activations == block_saved_bytes(
            candidate, acts, index + 1
        )
        assert lower.temporaries == t.block_backward(index)
        if engine is Engine.FSDP2:
            assert lower.comm_buffers == reduce_input + (t.gather_buffer_bytes if index else 0)
        else:
            assert lower.comm_buffers == 0 and lower.unsharded_params == t.gathered_bytes
    top_buffers = t.gather_buffer_bytes if engine is Engine.FSDP2 else 0
    assert walk[0].comm_buffers == top_buffers  # the next block's gather only
    assert candidate.checkpoints(0) and not candidate.checkpoints(1)
    assert walk[-1].temporaries > walk[-2].temporaries  # the bottom block recomputes


# The walk's state: which gradients a micro-batch's turns run beside.


def events_of(six_blocks, candidate: Candidate, **workload: object) -> list[MemoryEvent]:
    profile, acts = six_blocks
    return step_events(profile, candidate, TWO, WorkloadSpec(seq_len=128, **workload), acts)[0]


def test_under_lightnings_order_the_next_forward_holds_the_last_steps_gradients(
    six_blocks,
) -> None:
    """Lightning zeroes the gradients only before the next backward: after the optimizer step
    the walk runs the next step's forward turns beside the step's sharded gradients; a plain
    loop (zero_grad after step) ends at the step."""
    profile, acts = six_blocks
    candidate = fsdp2_every_2nd(profile)
    t = step_bytes(profile, candidate, TWO, WorkloadSpec(seq_len=128), acts)
    assert t.grad_shard_bytes > 0
    plain = events_of(six_blocks, candidate, loop="plain")
    assert plain[-1].name == "optimizer step" and plain[-1].turn is None
    lightning = events_of(six_blocks, candidate, loop="lightning")
    after = lightning[[e.name for e in lightning].index("optimizer step") + 1 :]
    first = {e.name: e.live for e in plain}
    assert [e.stage for e in after] == ["forward"] * len(after) and len(after) == 5
    for event in after:
        assert event.micro_batch == 1  # the next step's first
        assert event.name.endswith(", last step's gradients")
        name = event.name.removesuffix(", last step's gradients")
        if name in first:
            assert event.live.gradients == first[name].gradients + t.grad_shard_bytes
        else:  # the end of forward, below the loss without gradients
            assert name == "forward end" and event.live.gradients == t.grad_shard_bytes


def test_with_the_sync_skipped_a_later_micro_batch_runs_beside_the_kept_unsharded_gradients(
    six_blocks,
) -> None:
    """FSDP2 ``set_requires_gradient_sync(False)`` in a plain loop: the second micro-batch's
    forward and backward hold every trained parameter's unsharded gradient (in the fp32 reduce
    dtype), more than the sharded gradients; the first micro-batch holds none before its own
    backward, and the last micro-batch reduces them."""
    profile, acts = six_blocks
    candidate = fsdp2_every_2nd(profile)
    workload = WorkloadSpec(seq_len=128, loop="plain", accumulate=3)
    t = step_bytes(profile, candidate, TWO, workload, acts)
    assert t.kept_grad_bytes == profile.trainable_params * 4 > t.grad_shard_bytes
    events = events_of(six_blocks, candidate, loop="plain", accumulate=3)
    first = [e for e in events if e.micro_batch == 0 and e.stage == "forward"]
    assert first and all(e.live.gradients == 0 for e in first)
    later = [e for e in events if e.micro_batch == 1]
    stages = {e.stage for e in later}
    assert stages == {"forward", "backward"}
    for event in later:
        assert event.name.startswith("accumulating ")
        assert event.live.gradients >= t.kept_grad_bytes, event.name
    last = [e for e in events if e.micro_batch == 2 and e.stage == "backward"]
    assert [e.name for e in last] == ["synchronising top block backward"]
    assert last[0].live.gradients >= t.kept_grad_bytes


def test_with_the_sync_kept_a_later_micro_batch_reduces_into_the_carried_shards(
    six_blocks,
) -> None:
    """Lightning's Trainer with FSDP2 reduces every micro-batch: the second micro-batch's block
    backward holds every unit's sharded gradients, into which its own reductions are added
    (not a second set), beside the head's gradient waiting unsharded in the root."""
    profile, acts = six_blocks
    candidate = fsdp2_every_2nd(profile)
    workload = WorkloadSpec(seq_len=128, loop="lightning", accumulate=2)
    t = step_bytes(profile, candidate, TWO, workload, acts)
    events = events_of(six_blocks, candidate, loop="lightning", accumulate=2)
    later = [e for e in events if e.micro_batch == 1 and e.stage == "backward"]
    blocks = [e for e in later if e.turn and e.turn.name.startswith("block ")]
    assert len(blocks) >= 6
    for event in blocks:
        if event.name != "accumulating block backward":  # FSDP2's own rule
            assert event.live.gradients == t.grad_shard_bytes + t.head_grad_bytes, event.name


def test_each_event_carries_the_turn_of_the_timeline_it_happens_in(six_blocks) -> None:
    """The events hold their turn of the step's timeline (what it gathers, computes and
    reduces: where the speed model's seconds attach), their stage and micro-batch."""
    profile, _ = six_blocks
    candidate = fsdp2_every_2nd(profile)
    workload = WorkloadSpec(seq_len=128, loop="plain", accumulate=2)
    events = events_of(six_blocks, candidate, loop="plain", accumulate=2)
    timeline = step_timeline(
        candidate, TWO, workload, blocks=6, params=float(profile.total_params),
        block_params=float(profile.block_params),
    )  # fmt: skip
    turns = {*timeline[0].forward, *timeline[0].backward}
    at = {(e.name, e.micro_batch): e for e in events}
    assert (at["loss", 0].turn.name, at["loss", 0].stage) == ("root work", "forward")
    assert (at["head backward", 0].turn.name, at["head backward", 0].stage) == ("root", "backward")
    for index in range(6):
        event = at[block_event_names(index, 6)[0], 0]
        assert event.turn.name == f"block {index}" and event.turn in turns
        assert event.turn.gathered > 0  # resharded after forward: gathered again
    assert at["root backward", 0].turn.name == "root gradients"
    assert at["accumulating block backward", 1].turn.name == "block 0"
    assert at["synchronising top block backward", 1].turn.name == "block 5"
    step = at["optimizer step", 1]
    assert (step.turn, step.stage) == (None, "step")
    assert all(e.turn in turns for e in events if e.turn is not None)


def test_the_one_unit_runs_its_pass_in_one_turn(six_blocks) -> None:
    """Without a wrap policy the whole model is one unit: its forward turn holds the forward's
    events up to the loss, its backward turn the head's, the unit's and the root's."""
    candidate = Candidate(engine="fsdp2", precision="32-true", micro_batch_size=4)
    events = events_of(six_blocks, candidate, loop="plain", accumulate=2)
    assert {e.turn.name for e in events if e.turn is not None} == {"model"}
    first = [e.name for e in events if e.micro_batch == 0]
    assert first.index("loss") < first.index("head backward")
    assert first.index("head backward") < first.index("top block backward")
    assert first.index("top block backward") < first.index("root backward")
    later = [e.name for e in events if e.micro_batch == 1]
    assert "accumulating root backward" in later and "accumulating block backward" not in later


@pytest.mark.parametrize(
    ("engine", "reshard", "last_kept"),
    [
        ("fsdp1", Reshard.ALL, True),  # FSDP1 prefetches the last block whole
        ("fsdp2", Reshard.ALL, False),
        ("fsdp2", Reshard.KEEP_ROOT, False),
        ("fsdp2", Reshard.KEEP_ROOT_AND_LAST, True),
    ],
)
def test_a_loss_in_forward_and_the_heads_backward_hold_the_root_and_the_last_block_as_kept(
    six_blocks, engine: str, reshard: Reshard, last_kept: bool
) -> None:
    """A loss computed in forward (a Hugging Face model given labels) runs beside the root's
    backward hooks: the root gathered again and the last block as backward starts on it, what
    FSDP2's head backward holds too (one StepBytes field); FSDP1's head backward holds the
    root, the block computing and the one prefetched."""
    profile, acts = six_blocks
    in_forward = acts.model_copy(update={"loss_in_forward": True})
    candidate = Candidate(
        engine=engine, reshard=reshard, wrap_classes=profile.wrap_policy, precision="32-true"
    )
    workload = WorkloadSpec(seq_len=128, loop="plain")
    events = {e.name: e.live for e in step_events(profile, candidate, TWO, workload, in_forward)[0]}
    root, block = profile.root_unit_params * 4, profile.block_params * 4
    assert events["loss"].unsharded_params == root + (block if last_kept else 0)
    held = root + (block if last_kept else 0) if engine == "fsdp2" else root + 2 * block
    assert events["head backward"].unsharded_params == held
    # a loss outside the model: what the engine keeps gathered after forward, the root too
    # where FSDP1 and FSDP2's default keep it
    outside = {e.name: e.live for e in step_events(profile, candidate, TWO, workload, acts)[0]}
    kept = 0 if reshard is Reshard.ALL and engine == "fsdp2" else root
    assert outside["loss"].unsharded_params == kept + (
        block if last_kept and engine == "fsdp2" else 0
    )


GLOO_TWO = Hardware(gpus_per_node=2, gpu_memory=80 * GIB, backend="gloo")


def test_later_micro_batches_emit_their_own_events_at_their_turns(six_blocks) -> None:
    """Accumulating 3 micro-batches on 2 gloo ranks, FSDP1 (syncs skipped before the last) and
    FSDP2 under Lightning (every micro-batch reduces): each later micro-batch's events, named
    for the gradients beside it, at the turn they happen in, once each."""
    profile, acts = six_blocks
    workload = {"seq_len": 128, "accumulate": 3}

    def later(engine: str, loop: str) -> list[tuple[str, int, str | None]]:
        candidate = Candidate(
            engine=engine, wrap_classes=profile.wrap_policy, precision="32-true",
            micro_batch_size=4,
        )  # fmt: skip
        events = step_events(
            profile, candidate, GLOO_TWO, WorkloadSpec(loop=loop, **workload), acts
        )[0]
        return [
            (e.name, e.micro_batch, e.turn.name if e.turn else None)
            for e in events
            if 0 < e.micro_batch < 3 and e.stage == "backward"
        ]

    assert later("fsdp1", "plain") == [
        ("accumulating head backward", 1, "root"),
        ("accumulating block backward", 1, "block 0"),
        ("accumulating root backward", 1, "root gradients"),
        ("synchronising top block backward", 2, "block 5"),
        ("synchronising block reduce-scatter", 2, "block 0"),
        ("synchronising block backward", 2, "block 0"),
    ]
    reduced = later("fsdp2", "lightning")
    assert reduced[-2:] == [
        ("accumulating root backward", 1, "root gradients"),
        ("accumulating root reduce-scatter", 1, "root gradients"),
    ]
    assert ("accumulating block reduce-scatter", 1, "block 0") in reduced
