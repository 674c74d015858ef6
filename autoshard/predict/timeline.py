"""The events of one training step of a candidate on one rank, in the order FSDP runs them:
per micro-batch, the forward through the units (gather unit i, compute it), then the backward in
reverse (gather again what was freed, compute, recompute what is checkpointed, reduce the
unit's gradients), built from what the engine does (:mod:`autoshard.engine`).

The speed model gives each event its seconds (:mod:`autoshard.predict.speed`); what a new
dimension changes it changes here or there once: a checkpointing policy decides which work an
event recomputes (:func:`micro_batch`), a compiler or float8 how long a piece of work or a
collective takes (the speed model's rates).

>>> from autoshard.config import Candidate, Hardware, WorkloadSpec
>>> hardware = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30)
>>> step = step_timeline(Candidate(wrap_classes=("m.Block",)), hardware,
...                      WorkloadSpec(accumulate=4, loop="plain"), blocks=2,
...                      params=1000.0, block_params=300.0)
>>> [(m.count, m.reduces) for m in step]  # no_sync before the last micro-batch
[(1, True), (3, False)]
>>> [t.name for t in step[0].backward]
['root', 'block 1', 'block 0', 'root gradients']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.engine import policy_of, shard_size, skips_gradient_sync, traits


class Pass(str, Enum):
    """Which of a block's (or the rest of the model's) work a piece is."""

    FORWARD = "forward"
    BACKWARD = "backward"
    # the forward again, in backward (activation checkpointing); under selective checkpointing
    # only what its policy did not save (the speed model times that part)
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Work:
    """A piece of compute: one pass over ``blocks`` (their indices), or over the model's work
    outside the blocks (embedding, final norm, head, loss) when ``blocks`` is None."""

    kind: Pass
    blocks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Turn:
    """One FSDP unit's turn in a pass of one micro-batch: its parameters all-gathered first
    (``gathered`` elements, 0 when it is not gathered), then its ``work``, then its gradients
    reduced (``reduced`` elements, 0 when not)."""

    name: str
    gathered: float = 0.0
    work: tuple[Work, ...] = ()
    reduced: float = 0.0


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch's forward and backward turns, run ``count`` times in the step."""

    forward: tuple[Turn, ...]
    backward: tuple[Turn, ...]
    count: int
    reduces: bool


def _recomputed(candidate: Candidate, blocks: tuple[int, ...]) -> tuple[int, ...]:
    """Of ``blocks``, those that run their forward again in backward."""
    return tuple(i for i in blocks if candidate.checkpoints(i))


def micro_batch(
    candidate: Candidate,
    hardware: Hardware,
    *,
    blocks: int,
    params: float,
    block_params: float,
    reduces: bool,
    count: int = 1,
) -> MicroBatch:
    """The turns of one micro-batch of ``candidate`` (as run) over a model of ``params``
    parameters whose ``blocks`` blocks of ``block_params`` each are the units of its wrap policy
    (the rest is the root unit; with no wrap policy the whole model is one unit), reducing its
    gradients or not (``reduces``: the loop skips the sync)."""
    policy = policy_of(candidate)
    sharded = traits(candidate).shards_params and shard_size(candidate, hardware) > 1
    one_unit = candidate.one_unit or blocks == 0
    # what of the candidate the turns depend on, so that candidates alike share one timeline
    root, last, other = (
        sharded and policy.regathers(candidate, root=is_root, last=is_last)
        for is_root, is_last in ((True, False), (False, True), (False, False))
    )
    regathers = (root, last, other)  # gathered again in backward
    recomputed = _recomputed(candidate, tuple(range(blocks)))
    shape = _Shape(one_unit, blocks, params, block_params, sharded, regathers, recomputed)
    return _turns(shape, reduces, count)


@dataclass(frozen=True)
class _Shape:
    """All :func:`micro_batch` reads of a candidate and its model: the key of its memo."""

    one_unit: bool
    blocks: int
    params: float
    block_params: float
    sharded: bool
    regathers: tuple[bool, bool, bool]  # gathered again in backward: the root, last, other
    recomputed: tuple[int, ...]


@lru_cache(maxsize=256)
def _turns(shape: _Shape, reduces: bool, count: int) -> MicroBatch:
    """The micro-batch of a candidate of this ``shape`` (its turns are frozen: shared safely)."""
    blocks, params, block_params = shape.blocks, shape.params, shape.block_params
    every = tuple(range(blocks))

    def gather(n: float, *, root: bool = False, last: bool = False, again: bool = False) -> float:
        if not shape.sharded:
            return 0.0
        if again and not shape.regathers[0 if root else 1 if last else 2]:
            return 0.0
        return n

    def reduce(n: float) -> float:
        return n if reduces else 0.0

    if shape.one_unit:
        whole = (
            Work(Pass.BACKWARD, every),
            Work(Pass.BACKWARD),
            Work(Pass.RECOMPUTE, shape.recomputed),
        )
        return MicroBatch(
            (Turn("model", gather(params), (Work(Pass.FORWARD, every), Work(Pass.FORWARD))),),
            (Turn("model", gather(params, root=True, again=True), whole, reduce(params)),),
            count,
            reduces,
        )
    root = max(params - blocks * block_params, 0.0)
    forward: tuple[Turn, ...] = (
        Turn("root", gather(root)),
        *(Turn(f"block {i}", gather(block_params), (Work(Pass.FORWARD, (i,)),)) for i in every),
        Turn("root work", work=(Work(Pass.FORWARD),)),
    )
    back = [Turn("root", gather(root, root=True, again=True), (Work(Pass.BACKWARD),))]
    checkpointed = frozenset(shape.recomputed)
    for i in reversed(every):
        rerun = (i,) if i in checkpointed else ()
        work = (Work(Pass.BACKWARD, (i,)), Work(Pass.RECOMPUTE, rerun))
        gathered = gather(block_params, last=i == blocks - 1, again=True)
        back.append(Turn(f"block {i}", gathered, work, reduce(block_params)))
    back.append(Turn("root gradients", reduced=reduce(root)))
    return MicroBatch(forward, tuple(back), count, reduces)


def step_timeline(
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    blocks: int,
    params: float,
    block_params: float,
    skip_sync: bool | None = None,
) -> list[MicroBatch]:
    """The micro-batches of one optimizer step: the last reduces its gradients; the others do
    too unless the loop skips their sync (``skip_sync``; None: as the engine does under
    ``workload.loop``, :func:`autoshard.engine.skips_gradient_sync`)."""
    if skip_sync is None:
        skip_sync = skips_gradient_sync(candidate, workload)

    def one(reduces: bool, count: int) -> MicroBatch:
        return micro_batch(
            candidate, hardware, blocks=blocks, params=params, block_params=block_params,
            reduces=reduces, count=count,
        )  # fmt: skip

    accumulate = workload.accumulate
    if skip_sync and accumulate > 1:
        return [one(True, 1), one(False, accumulate - 1)]
    return [one(True, accumulate)]


Unit = tuple[float, float, float]  # (gather seconds, compute seconds, reduce seconds)


def _slowed(compute: float, busy: float, slowdown: float) -> float:
    """Seconds ``compute`` seconds of work take when a collective occupies the first ``busy``
    seconds beside them, running ``1 + slowdown`` times slower meanwhile."""
    if slowdown <= 0 or busy <= 0:
        return compute
    if compute * (1 + slowdown) <= busy:
        return compute * (1 + slowdown)
    return busy + compute - busy / (1 + slowdown)


def two_streams(
    units: Sequence[Unit],
    *,
    prefetch: bool = True,
    slowdown: float = 0.0,
    windows: list[tuple[float, float]] | None = None,
) -> tuple[float, float]:
    """(elapsed seconds, communication seconds) of ``units`` run in order on two streams: one
    computes, one communicates (collectives in the order they are issued). A unit computes
    once its gather is done and the unit before it has computed; its gather is issued when the
    unit before it starts computing (``prefetch``: FSDP's forward and backward prefetch) or
    when it is reached; its reduction is issued when its compute is done. While collectives
    run beside a unit's compute, that compute runs ``1 + slowdown`` times slower (the
    collectives are not slowed: their kernels are small and bandwidth-bound). ``windows``, when
    given, receives each unit's (start, end) seconds on the compute stream.

    >>> from autoshard.predict.timeline import two_streams
    >>> two_streams([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)])  # the second gather hides
    (5.0, 2.0)
    >>> two_streams([(1.0, 2.0, 1.0)])  # one unit: nothing hides
    (4.0, 2.0)
    >>> round(two_streams([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)], slowdown=0.5)[0], 3)  # at a price
    5.333
    """
    if not units:
        return 0.0, 0.0
    comm_free = gathered = units[0][0]
    compute_free = 0.0
    for i, (_, compute, reduce) in enumerate(units):
        start = max(compute_free, gathered)
        following = units[i + 1][0] if i + 1 < len(units) else None
        if following is not None and prefetch:
            comm_free = max(comm_free, start) + following
            gathered = comm_free
        # Every collective queued so far was issued by ``start``: the stream is busy without a
        # gap from ``start`` until ``comm_free``.
        duration = _slowed(compute, comm_free - start, slowdown)
        if following is not None and not prefetch:
            comm_free = max(comm_free, start + duration) + following
            gathered = comm_free
        compute_free = start + duration
        if windows is not None:
            windows.append((start, compute_free))
        if reduce:
            comm_free = max(comm_free, compute_free) + reduce
    comm = sum(g + r for g, _, r in units)
    return max(compute_free, comm_free), comm


Window = tuple[float, float]  # (start, end) seconds of a turn's compute, from its pass's start


@dataclass(frozen=True)
class PassSeconds:
    """One micro-batch's forward or backward on the compute stream: each turn's window, and
    when the pass is done (its last reduction included)."""

    windows: tuple[Window, ...]
    elapsed: float


def pass_seconds(
    units: Sequence[Unit], prefetch: bool, slowdown: float, overlap: float
) -> PassSeconds:
    """The windows of ``units`` on the schedule whose elapsed seconds the speed model's step
    counts (its compute, recompute, exposed communication and contention): the two-stream
    timeline with the compute ``slowdown`` slower beside the collectives, weighted by
    ``overlap`` (the share of communication that may hide) against the serial one (each unit's
    gather, compute and reduction in turn: what blocking collectives run).

    >>> from autoshard.predict.timeline import pass_seconds
    >>> pass_seconds([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)], True, 0.0, 1.0)  # as two_streams
    PassSeconds(windows=((1.0, 3.0), (3.0, 5.0)), elapsed=5.0)
    >>> pass_seconds([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)], True, 0.0, 0.0).windows[1]  # serial
    (4.0, 6.0)
    """
    overlapped: list[Window] = []
    slowed = two_streams(units, prefetch=prefetch, slowdown=slowdown, windows=overlapped)[0]
    clock = 0.0  # the serial schedule's
    windows = []
    for (gather, compute, reduce), (start, end) in zip(units, overlapped, strict=True):
        serial_start = clock + gather
        clock = serial_start + compute + reduce
        windows.append(
            (
                overlap * start + (1 - overlap) * serial_start,
                overlap * end + (1 - overlap) * (serial_start + compute),
            )
        )
    return PassSeconds(tuple(windows), overlap * slowed + (1 - overlap) * clock)
