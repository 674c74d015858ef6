"""The memory side of the step timeline (:mod:`autoshard.predict.timeline`): the events of one
training step of a candidate on one rank, each with the bytes live then (a
:class:`~autoshard.results.MemoryBreakdown`, before the allowance) and the turn of the timeline
it happens in. The memory peak is the largest of them (:func:`peak_event`), and its name is the
moment the report shows.

The events come from walking the timeline's turns in the order the step runs them: per
micro-batch the forward turns (the root, each block, the root's work: the loss), then the
backward turns (the root's re-gather and the head, each block from the top down, the root's
gradients), then the optimizer step, and under Lightning's order the next step's forward. The
walk's state is which gradients a micro-batch runs beside (:class:`Gradients`): none (the first
micro-batch: ``zero_grad`` set them to None), the earlier micro-batches' kept unsharded (the
sync skipped) or reduced into shards (the sync kept), the kept ones being reduced (the last
micro-batch after skipped syncs), or the last step's (Lightning zeroes them only before the
next backward). The loop's order and accumulation are that state, not families of their own;
the blocks' backward is a running ledger of the activations still saved. At each turn the walk
asks the rules of what the engine holds there (:mod:`autoshard.predict.forward_events`,
:mod:`autoshard.predict.backward_events`, and :mod:`autoshard.predict.accumulation` where a
later micro-batch holds something else than the first) and adds the carried gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Literal, TypeAlias

from autoshard.config import Candidate, Engine, Hardware, Loop, WorkloadSpec
from autoshard.engine import skips_gradient_sync
from autoshard.predict import accumulation as acc
from autoshard.predict import backward_events as bwd
from autoshard.predict import forward_events as fwd
from autoshard.predict.activations import ActivationProfile
from autoshard.predict.step_bytes import StepBytes, step_bytes
from autoshard.predict.timeline import MicroBatch, Turn, step_timeline
from autoshard.results import MemoryBreakdown, ModelProfile

Live: TypeAlias = MemoryBreakdown | None  # at an event; None where the engine holds no such event
Stage: TypeAlias = Literal["forward", "backward", "step"]


class Gradients(str, Enum):
    """The gradients a micro-batch's turns run beside: the walk's state."""

    NONE = "none"  # set to None by zero_grad before the micro-batch
    KEPT = "kept"  # the earlier micro-batches', unsharded (the sync skipped)
    REDUCED = "reduced"  # the earlier micro-batches', reduced into shards (the sync kept)
    SYNCING = "synchronising"  # the kept ones, reduced by this (the last) micro-batch
    LAST_STEP = "last step's"  # the last step's sharded ones (Lightning's next forward)

    def name_of(self, event: str) -> str:
        """The report's name of ``event`` in a micro-batch with these gradients."""
        match self:
            case Gradients.NONE:
                return event
            case Gradients.KEPT | Gradients.REDUCED:
                return f"accumulating {event}"
            case Gradients.SYNCING:
                return f"synchronising {event}"
            case Gradients.LAST_STEP:
                return f"{event}, last step's gradients"


@dataclass(frozen=True)
class MemoryEvent:
    """A point of the step where the live bytes can peak: ``name`` says which (the moment the
    report shows), ``live`` what is allocated then; ``turn`` is the timeline's turn it happens
    in (its gather, work and reduction: the speed model's seconds attach there; None for the
    optimizer step), ``stage`` whether in a micro-batch's forward or backward or the optimizer
    step, ``micro_batch`` which (0 the first; the step's accumulation count: the next step's
    first, under Lightning's order)."""

    name: str
    live: MemoryBreakdown
    turn: Turn | None = None
    stage: Stage = "step"
    micro_batch: int = 0


def _block_index(turn: Turn) -> int | None:
    """The index of a block's turn, None for the root's or the one unit's."""
    return _index_in(turn.name)


@functools.cache  # the same few hundred names, every candidate's every micro-batch
def _index_in(name: str) -> int | None:
    return int(name.split()[1]) if name.startswith("block ") else None


@dataclass
class _Walk:
    """The walk over the step's turns: its state, and the events emitted so far."""

    t: StepBytes
    blocks: int  # block units (0: the whole model is one unit)
    events: list[MemoryEvent] = field(default_factory=list)
    # the first micro-batch's events by name: a later one's rules start from the plain event
    first: dict[str, MemoryBreakdown] = field(default_factory=dict)
    # ... and the names of those at each block's backward turn (by the block's index)
    first_at_block: dict[int, list[str]] = field(default_factory=dict)
    gradients: Gradients = Gradients.NONE
    micro_batch: int = 0
    activations: int = 0  # saved, walking down the blocks' backward
    top: MemoryBreakdown | None = None  # the top block's backward event of this micro-batch
    bottom: MemoryBreakdown | None = None  # the bottom block's

    def emit(self, turn: Turn | None, stage: Stage, named: Iterable[tuple[str, Live]]) -> None:
        """Emit the events ``named`` (name, breakdown or None where the engine holds no such
        event) at ``turn``, beside the gradients carried into the micro-batch and named for
        them."""
        first = self.gradients is Gradients.NONE
        carried = 0 if first else self.carried()
        for name, live in named:
            if live is None:
                continue
            if first:
                self.first[name] = live
            else:
                live = live.model_copy(update={"gradients": live.gradients + carried})
                name = self.gradients.name_of(name)
            self.events.append(MemoryEvent(name, live, turn, stage, self.micro_batch))

    def carried(self) -> int:
        """Bytes of the gradients carried into this micro-batch."""
        match self.gradients:
            case Gradients.KEPT | Gradients.SYNCING:
                return self.t.kept_grad_bytes
            case Gradients.REDUCED | Gradients.LAST_STEP:
                return self.t.grad_shard_bytes
        return 0

    # -- forward ---------------------------------------------------------------------------

    @cached_property
    def forward_rules(self) -> tuple[dict[str, MemoryBreakdown], ...]:
        """The forward's events without carried gradients, at the root's turn, the last
        block's and the root's work (every micro-batch's forward holds the same working set)."""
        t = self.t
        return fwd.forward_start(t), fwd.last_block_forward(t), fwd.forward_end(t)

    def forward(self, turn: Turn) -> None:
        """A forward turn: the root's start, the last block's, the root's work (the loss); the
        one unit's runs all three."""
        if self.gradients is Gradients.SYNCING:
            return  # its forward holds what a later micro-batch's forward holds: emitted there
        t = self.t
        index = _block_index(turn)
        if index is not None and index != self.blocks - 1:
            return  # a block's forward below the last holds less than the last's
        events: dict[str, MemoryBreakdown] = {}
        if turn.name in ("root", "model"):
            events |= self.forward_rules[0]
        if turn.name == "model" or index == self.blocks - 1:
            events |= self.forward_rules[1]
        if turn.name in ("root work", "model"):
            events |= self.forward_rules[2]
            if self.gradients is Gradients.NONE:
                # without gradients the loss, emitted after it, holds the same and more
                del events["forward end"]
            if self.gradients is Gradients.LAST_STEP and t.engine is not Engine.FSDP1:
                # FSDP2's zero_grad sets the gradients to None before the loss; FSDP1's sharded
                # flat gradients live on until the root's pre-backward hook, which runs once
                # the loss's backward reaches the logits (measured on 2 gloo processes and on
                # fake tensors, every sharding)
                del events["loss"]
        self.emit(turn, "forward", events.items())

    # -- backward --------------------------------------------------------------------------

    def backward(self, turn: Turn) -> None:
        """A backward turn: the root's (the head), a block's, the root's gradients; the one
        unit's runs all three, its block part as a single top and bottom block."""
        index = _block_index(turn)
        if turn.name in ("root", "model"):
            self.head(turn)
        if turn.name == "model":
            self.block(turn, 0, 1)
        elif index is not None:
            self.block(turn, index, self.blocks)
        if turn.name in ("root gradients", "model"):
            self.root_gradients(turn)

    def head(self, turn: Turn) -> None:
        """The root re-gathered (FSDP2's backward start) and the head's backward."""
        t = self.t
        if self.gradients is Gradients.SYNCING:
            return  # as a later micro-batch's: emitted there
        start_from = head = bwd.head_backward(t)
        if self.gradients is Gradients.KEPT:
            start_from = acc.kept_head(t, head)
            head = acc.kept_head_backward(t, start_from)
        elif self.gradients is Gradients.REDUCED:
            start_from = head = acc.unreduced(t, head)
        start = bwd.backward_start(t, start_from)
        held = bwd.gloo_held_root(t, start)
        named = [
            ("backward start", start),
            ("backward start, last block prefetched", held),
            ("head backward", head),
        ]
        self.emit(turn, "backward", named)

    def block(self, turn: Turn, index: int, blocks: int) -> None:
        """Block ``index`` of ``blocks``: its backward, walked down from the top, and what its
        reduction holds, by the gradients beside it."""
        rule = _BLOCK_RULES[self.gradients]
        self.emit(turn, "backward", rule(self, index, blocks))

    def _first_block(self, index: int, blocks: int) -> list[tuple[str, Live]]:
        """The first micro-batch: the running ledger of the activations still saved, walking
        down from the top block."""
        t = self.t
        top, bottom = index == blocks - 1, index == 0
        named: list[tuple[str, Live]] = []
        if top:
            self.top = self.bottom = bwd.top_block_backward(t, self.first["head backward"])
            self.activations = self.top.activations
        assert self.top is not None and self.bottom is not None
        if t.reshards_blocks:
            if not top:  # the block above's backward freed what it saved
                self.activations -= bwd.freed_by_block(t, index + 1)
            self.bottom = bwd.block_backward(t, self.top, index, self.activations)
            named += [(n, self.bottom) for n in bwd.block_event_names(index, blocks)]
        elif top:  # every unit held all along: the top block is the worst
            named.append(("top block backward", self.top))
        if top:
            named.append(("top block gradient", bwd.fsdp1_flat_gradient(t, self.top, top=True)))
        if bottom:
            flat = bwd.fsdp1_flat_gradient(t, self.bottom, top=False)
            named.append(("bottom block gradient", flat))
            copy = bwd.gloo_block_reduce_scatter(t, self.bottom)
            named.append(("block reduce-scatter", copy))
        self.first_at_block[index] = [n for n, live in named if live is not None]
        return named

    def _kept_block(self, index: int, blocks: int) -> list[tuple[str, Live]]:
        """A later micro-batch after skipped syncs: one event, at the bottom block's turn (the
        most of the kept gradients' temporaries)."""
        if index:
            return []
        return [("block backward", acc.kept_block_backward(self.t, self.first["head backward"]))]

    def _synchronising_block(self, index: int, blocks: int) -> list[tuple[str, Live]]:
        """The last micro-batch after skipped syncs: the top block reduces while the others'
        gradients are kept; the worst block below it (FSDP1) and gloo's copy at the bottom's."""
        t = self.t
        named: list[tuple[str, Live]] = []
        if index == blocks - 1:
            second = self.first.get("second block backward")
            self.top = acc.synchronising_top_block(t, self.first["top block backward"], second)
            named.append(("top block backward", self.top))
        if index == 0:
            assert self.top is not None
            named.append(("block reduce-scatter", acc.synchronising_reduce_scatter(t, self.top)))
            named.append(("block backward", acc.fsdp1_synchronising_blocks(t, self.top)))
        return named

    def _reduced_block(self, index: int, blocks: int) -> list[tuple[str, Live]]:
        """A later micro-batch of synced accumulation: the first micro-batch's events at this
        turn with their own unsharded gradients only; FSDP2's own at the bottom block's."""
        t = self.t
        names = self.first_at_block[index]
        named: list[tuple[str, Live]] = [(n, acc.unreduced(t, self.first[n])) for n in names]
        if index == 0:
            head = self.first["head backward"]
            named.append(("block backward", acc.fsdp2_reduced_block_backward(t, head)))
        return named

    def root_gradients(self, turn: Turn) -> None:
        """The root's backward, its gradients reduced last."""
        t = self.t
        named: list[tuple[str, Live]] = []
        if self.gradients is Gradients.NONE:
            root = bwd.root_backward(t)
            named += [
                ("root backward", root),
                ("root reduce-scatter", bwd.gloo_root_reduce_scatter(t, root)),
                ("bottom block's flat gradient", bwd.fsdp1_unsharded_flat_gradient(t, root)),
                ("root gradient concatenated", bwd.fsdp1_offloaded_root_gradient(t, root)),
            ]
        elif self.gradients is Gradients.KEPT:
            named.append(("root backward", acc.kept_root_backward(t, self.first["head backward"])))
        elif self.gradients is Gradients.REDUCED:
            first_root = self.first["root backward"]
            root = acc.unreduced(t, first_root)
            named.append(("root backward", acc.fsdp2_reduced_root_backward(t, root)))
            if "root reduce-scatter" in self.first:
                copy = self.first["root reduce-scatter"]
                named.append(("root reduce-scatter", acc.unreduced(t, copy)))
            step = bwd.optimizer_step(t)
            named += acc.fsdp2_reduced_gradients_waiting(t, root, first_root, step).items()
        self.emit(turn, "backward", named)

    # -- the step --------------------------------------------------------------------------

    def micro_batch_turns(self, mb: MicroBatch, gradients: Gradients, index: int) -> None:
        """Walk one micro-batch's turns beside ``gradients``."""
        self.gradients, self.micro_batch = gradients, index
        for turn in mb.forward:
            self.forward(turn)
        if gradients is Gradients.LAST_STEP:
            return  # zero_grad frees them before this backward
        for turn in mb.backward:
            self.backward(turn)

    def optimizer_step(self, micro_batch: int) -> None:
        """The optimizer step, after the last micro-batch (``micro_batch``)."""
        self.gradients, self.micro_batch = Gradients.NONE, micro_batch
        self.emit(None, "step", [("optimizer step", bwd.optimizer_step(self.t))])


# the walk's rule for a block's turn, by the gradients beside it (LAST_STEP: no backward)
_BLOCK_RULES = {
    Gradients.NONE: _Walk._first_block,
    Gradients.KEPT: _Walk._kept_block,
    Gradients.SYNCING: _Walk._synchronising_block,
    Gradients.REDUCED: _Walk._reduced_block,
}


def _micro_batches(t: StepBytes) -> list[Gradients]:
    """The gradients each micro-batch of the step runs beside that makes its events differ:
    the first none; with accumulation a later one the kept or the reduced ones, and after
    skipped syncs the last reduces the kept ones (the later ones between hold the same)."""
    if t.workload.accumulate == 1:
        return [Gradients.NONE]
    if skips_gradient_sync(t.candidate, t.workload):
        return [Gradients.NONE, Gradients.KEPT, Gradients.SYNCING]
    return [Gradients.NONE, Gradients.REDUCED]


def step_events(
    profile: ModelProfile,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    acts: ActivationProfile,
) -> tuple[list[MemoryEvent], int]:
    """The memory events of one training step of ``candidate``, in the order they happen, and
    the host bytes per node (what is offloaded)."""
    t = step_bytes(profile, candidate, hardware, workload, acts)
    return walk_step(t, hardware, workload), t.host_bytes


def walk_step(t: StepBytes, hardware: Hardware, workload: WorkloadSpec) -> list[MemoryEvent]:
    """The memory events of the step whose bytes are ``t`` (:func:`step_events`)."""
    profile = t.profile
    blocks = 0 if t.candidate.one_unit else max(profile.block_count, 1)
    step = step_timeline(
        t.candidate, hardware, workload, blocks=blocks,
        params=float(profile.total_params), block_params=float(profile.block_params),
    )  # fmt: skip
    # Every micro-batch runs the same turns; what differs is the gradients beside them.
    turns = step[0]
    walk = _Walk(t, blocks)
    micro_batches = _micro_batches(t)
    for gradients in micro_batches:
        index = {Gradients.NONE: 0, Gradients.SYNCING: workload.accumulate - 1}.get(gradients, 1)
        walk.micro_batch_turns(turns, gradients, index)
    walk.optimizer_step(workload.accumulate - 1)
    if workload.loop == Loop.LIGHTNING:
        walk.micro_batch_turns(turns, Gradients.LAST_STEP, workload.accumulate)
    return walk.events


def peak_event(events: list[MemoryEvent]) -> MemoryEvent:
    """The event with the most live bytes (the earliest of equals)."""
    return max(events, key=lambda e: e.live.total)
