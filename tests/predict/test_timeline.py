"""The step timeline (autoshard/predict/timeline.py): the turns of each unit in the order FSDP
runs them, what each gathers, computes, recomputes and reduces, per micro-batch, and the two
streams their seconds run on."""

from __future__ import annotations

import doctest

import pytest

from autoshard.config import Candidate, Engine, Hardware, Loop, Reshard, WorkloadSpec
from autoshard.predict import timeline as timeline_module
from autoshard.predict.timeline import Pass, Work, micro_batch, step_timeline

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
    def shape(engine: Engine, loop: Loop, **kw: object) -> list[tuple[int, bool]]:
        workload = WorkloadSpec(loop=loop, accumulate=4)
        step = step_timeline(blocks(engine=engine), EIGHT, workload, **SHAPE, **kw)  # type: ignore[arg-type]
        return [(mb.count, mb.reduces) for mb in step]

    assert shape(Engine.FSDP1, Loop.LIGHTNING) == [(1, True), (3, False)]
    assert shape(Engine.FSDP2, Loop.LIGHTNING) == [(4, True)]
    assert shape(Engine.FSDP2, Loop.PLAIN) == [(1, True), (3, False)]
    assert shape(Engine.FSDP1, Loop.PLAIN, skip_sync=False) == [(4, True)]  # Composer's way
    skipped = step_timeline(blocks(), EIGHT, WorkloadSpec(accumulate=4), **SHAPE)[1]
    assert all(t.reduced == 0 for t in skipped.backward)


def test_the_examples_in_the_docstrings_run() -> None:
    result = doctest.testmod(timeline_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0
