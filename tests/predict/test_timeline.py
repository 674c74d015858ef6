"""The step timeline (autoshard/predict/timeline.py): the turns of each unit in the order FSDP
runs them, what each gathers, computes, recomputes and reduces, per micro-batch, and the two
streams their seconds run on. The step's memory events along these turns:
tests/predict/test_step_memory.py."""

from __future__ import annotations

import doctest

import pytest

from autoshard.config import Candidate, Engine, Hardware, Loop, Reshard, WorkloadSpec
from autoshard.predict import timeline as timeline_module
from autoshard.predict.timeline import Pass, Work, micro_batch, step_timeline, two_streams

GIB = 2**30
EIGHT = Hardware(gpus_per_node=8, gpu_memory=80 * GIB)
SHAPE = {"blocks": 3, "params": 1000.0, "block_params": 100.0}  # a root of 700


def blocks(**kw: object) -> Candidate:
    return Candidate(wrap_classes=("m.Block",), checkpoint_classes=("m.Block",), **kw)


def test_a_micro_batch_gathers_each_unit_before_it_computes_and_reduces_after() -> None:
    mb = micro_batch(blocks(), EIGHT, reduces=True, **SHAPE)
    assert [(t.name, t.gathered, t.work, t.reduced) for t in mb.forward] == [
        ("root", 700.0, (), 0.0),  # gathered first; its work runs after the blocks'
        ("block 0", 100.0, (Work(Pass.FORWARD, (0,)),), 0.0),
        ("block 1", 100.0, (Work(Pass.FORWARD, (1,)),), 0.0),
        ("block 2", 100.0, (Work(Pass.FORWARD, (2,)),), 0.0),
        ("root work", 0.0, (Work(Pass.FORWARD),), 0.0),
    ]
    # FSDP1 keeps the root gathered into backward; the blocks come back in reverse and reduce
    assert [(t.name, t.gathered, t.reduced) for t in mb.backward] == [
        ("root", 0.0, 0.0),
        ("block 2", 100.0, 100.0),
        ("block 1", 100.0, 100.0),
        ("block 0", 100.0, 100.0),
        ("root gradients", 0.0, 700.0),
    ]


@pytest.mark.parametrize(
    ("reshard", "root", "last"),
    [(Reshard.ALL, 700.0, 100.0), (Reshard.KEEP_ROOT, 0.0, 100.0),
     (Reshard.KEEP_ROOT_AND_LAST, 0.0, 0.0)],
)  # fmt: skip
def test_the_reshard_policy_decides_what_backward_gathers_again(
    reshard: Reshard, root: float, last: float
) -> None:
    mb = micro_batch(blocks(engine=Engine.FSDP2, reshard=reshard), EIGHT, reduces=True, **SHAPE)
    gathered = {t.name: t.gathered for t in mb.backward}
    assert (gathered["root"], gathered["block 2"], gathered["block 1"]) == (root, last, 100.0)
    grad_op = blocks(engine=Engine.FSDP2, reshard=reshard, sharding="SHARD_GRAD_OP")
    kept = micro_batch(grad_op, EIGHT, reduces=True, **SHAPE)
    assert all(t.gathered == 0 for t in kept.backward)  # nothing was freed after forward


def test_nothing_is_gathered_without_a_shard_dimension() -> None:
    for candidate, hardware in [
        (blocks(sharding="NO_SHARD"), EIGHT),
        (blocks(engine=Engine.FSDP2), Hardware(gpus_per_node=1, gpu_memory=GIB)),
    ]:
        mb = micro_batch(candidate, hardware, reduces=True, **SHAPE)
        assert all(t.gathered == 0 for t in mb.forward + mb.backward)


def test_checkpointing_decides_which_blocks_recompute_in_backward() -> None:
    def recomputed(candidate: Candidate) -> list[int]:
        mb = micro_batch(candidate, EIGHT, reduces=True, **SHAPE)
        work = [w for t in mb.backward for w in t.work if w.kind is Pass.RECOMPUTE]
        return sorted(i for w in work for i in w.blocks or ())

    assert recomputed(blocks()) == []
    assert recomputed(blocks(checkpointing="all")) == [0, 1, 2]
    assert recomputed(blocks(checkpointing="every_k", checkpoint_every=2)) == [0, 2]
    one_unit = Candidate(checkpointing="all", checkpoint_classes=("m.Block",))
    (turn,) = micro_batch(one_unit, EIGHT, reduces=True, **SHAPE).backward
    assert turn.gathered == 0  # FSDP1 keeps its one (root) unit gathered into backward
    assert turn.work == (
        Work(Pass.BACKWARD, (0, 1, 2)),
        Work(Pass.BACKWARD),
        Work(Pass.RECOMPUTE, (0, 1, 2)),
    )
    assert turn.reduced == 1000.0


def test_accumulation_reduces_every_micro_batch_or_only_the_last_by_engine_and_loop() -> None:
    def shape(
        engine: Engine, loop: Loop, accumulate: int = 4, **kw: object
    ) -> list[tuple[int, bool]]:
        workload = WorkloadSpec(loop=loop, accumulate=accumulate)
        step = step_timeline(blocks(engine=engine), EIGHT, workload, **SHAPE, **kw)  # type: ignore[arg-type]
        return [(mb.count, mb.reduces) for mb in step]

    assert shape(Engine.FSDP1, Loop.LIGHTNING) == [(1, True), (3, False)]
    assert shape(Engine.FSDP2, Loop.LIGHTNING) == [(4, True)]
    assert shape(Engine.FSDP2, Loop.PLAIN) == [(1, True), (3, False)]
    assert shape(Engine.FSDP1, Loop.PLAIN, skip_sync=False) == [(4, True)]  # Composer's way
    skipped = step_timeline(blocks(), EIGHT, WorkloadSpec(accumulate=4), **SHAPE)[1]
    assert all(t.reduced == 0 for t in skipped.backward)
    # two micro-batches: the first skips its sync too
    assert shape(Engine.FSDP1, Loop.LIGHTNING, accumulate=2) == [(1, True), (1, False)]


def test_the_examples_in_the_docstrings_run() -> None:
    result = doctest.testmod(timeline_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


def test_timeline_hides_a_prefetched_gather_behind_the_previous_compute() -> None:
    # gather 1 | compute 2 of unit 0 while unit 1's gather (1) runs | compute 2
    assert two_streams([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)]) == (5.0, 2.0)
    # a gather longer than the compute it hides behind shows by the difference
    assert two_streams([(1.0, 2.0, 0.0), (3.0, 2.0, 0.0)]) == (6.0, 4.0)
    # without prefetch the second gather waits for the first compute to end
    assert two_streams([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)], prefetch=False) == (6.0, 2.0)
    # a reduction runs behind the next unit's compute; the last one is exposed
    assert two_streams([(0.0, 2.0, 1.0), (0.0, 2.0, 1.0)]) == (5.0, 2.0)


def test_compute_beside_a_collective_runs_slower_by_the_slowdown() -> None:
    # gather 1 | unit 0's compute (2 s of work) shares its first second with unit 1's gather
    # and does 1/1.5 s of work in it; the other 4/3 s of work run alone | unit 1 alone: 2
    elapsed, comm = two_streams([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)], slowdown=0.5)
    assert elapsed == pytest.approx(1 + 1 + 4 / 3 + 2) and comm == 2.0
    # a reduction slows the next unit's compute the same way, prefetching or not
    for prefetch in (True, False):
        reduced = two_streams([(0.0, 2.0, 1.0), (0.0, 2.0, 1.0)], prefetch=prefetch, slowdown=0.5)
        assert reduced[0] == pytest.approx(2 + 1 + 4 / 3 + 1)
    # compute wholly beside a longer gather is slowed but waited for anyway: no cost, as long as
    # the slowed compute (2 x 1.5 = 3 s) still ends inside the gather's 3.5
    assert two_streams([(1.0, 2.0, 0.0), (3.5, 2.0, 0.0)], slowdown=0.5)[0] == 1 + 3.5 + 2
    assert two_streams([(1.0, 2.0, 0.0), (5.0, 2.0, 0.0)], slowdown=0.5)[0] == pytest.approx(8.0)
    # nothing beside the compute (no prefetch): nothing slowed
    assert two_streams([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)], prefetch=False, slowdown=0.5) == (
        6.0,
        2.0,
    )


def test_compute_wholly_beside_a_collective_takes_its_work_times_the_slowdown() -> None:
    assert timeline_module._slowed(2.0, 4.0, 0.5) == 3.0  # 3 s, all of it beside the collective
    assert timeline_module._slowed(2.0, 3.0, 0.5) == 3.0  # ends as the collective does
    assert timeline_module._slowed(2.0, 1.5, 3.0) == pytest.approx(1.5 + 2 - 1.5 / 4)
    assert timeline_module._slowed(2.0, 4.0, 0.0) == timeline_module._slowed(2.0, 0.0, 0.5) == 2.0
