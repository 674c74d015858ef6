"""The memory side of the step timeline (:mod:`autoshard.predict.timeline`): the events of one
training step of a candidate on one rank, in the order the engine runs them, each with the bytes
live then (a :class:`~autoshard.results.MemoryBreakdown`, before the allowance). The memory peak
is the largest of them (:func:`peak_event`), and its name is the moment the report shows.

The step is walked as the timeline lays it out: per micro-batch the forward through the units,
the loss, the backward in reverse (the root's re-gather and the head, each block's turn, the
root's gradients), then the optimizer step; the first micro-batch, those that run beside the
earlier ones' gradients (``accumulating``), the last one that reduces them after skipped syncs
(``synchronising``), the optimizer step, and under Lightning's order the next step's forward
beside this step's gradients. The blocks' backward is a walk over the timeline's block turns
(:func:`blocks_backward_events`); the other events' bytes are the rules of
:mod:`autoshard.predict.moments`, :mod:`autoshard.predict.loop_moments` and
:mod:`autoshard.predict.accumulation`, each placed at the turn where it happens.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.config import Candidate, Hardware, WorkloadSpec
from autoshard.predict.activations import ActivationProfile
from autoshard.predict.loop_moments import loop_moments
from autoshard.predict.moments import block_event_names, step_moments
from autoshard.predict.step_bytes import step_bytes
from autoshard.predict.timeline import MicroBatch, step_timeline
from autoshard.results import MemoryBreakdown, ModelProfile


@dataclass(frozen=True)
class MemoryEvent:
    """A point of the step where the live bytes can peak: ``name`` says which (the moment the
    report shows), ``live`` what is allocated then."""

    name: str
    live: MemoryBreakdown


# What each of the timeline's turns holds, in the order the turn runs it (a micro-batch's
# forward turns, then its backward turns); names of the moment rules that happen there.
_FORWARD_TURNS = {
    "root": ("forward start",),
    "last block": ("last block all-gather", "last block forward"),
    "root work": ("root forward end", "forward end", "loss"),
}
_BACKWARD_TURNS = {
    "root": ("backward start", "backward start, last block prefetched", "head backward"),
    "top block": ("top block gradient",),
    "bottom block": (
        "bottom block gradient",
        "block reduce-scatter",
        "synchronising block reduce-scatter",
        "block backward",
    ),
    "root gradients": (
        "root backward",
        "root reduce-scatter",
        "bottom block's flat gradient",
        "root backward, reduced gradients waiting",
        "backward end",
    ),
}


def _turn_names(
    turns: dict[str, tuple[str, ...]], turn: str, blocks: int, *, backward: bool
) -> tuple[str, ...]:
    """The moment names a turn of the timeline holds (block turns by their place)."""
    if turn == "model":  # the one unit: its turn runs what the root's and the blocks' do
        names = tuple(n for names in turns.values() for n in names)
        if backward:  # the unit's backward, after the head's
            at = names.index("head backward") + 1
            names = (*names[:at], "top block backward", *names[at:])
        return names
    if not turn.startswith("block "):
        return turns.get(turn, ())
    index = int(turn.split()[1])
    if not backward:
        return turns["last block"] if index == blocks - 1 else ()
    names = turns["top block"] if index == blocks - 1 else ()
    names = block_event_names(index, blocks) + names
    return names + turns["bottom block"] if index == 0 else names


def _micro_batch_names(mb: MicroBatch, blocks: int) -> list[str]:
    """The moment names of one micro-batch, in the order its turns run."""
    names: list[str] = []
    for turn in mb.forward:
        names += _turn_names(_FORWARD_TURNS, turn.name, blocks, backward=False)
    for turn in mb.backward:
        names += _turn_names(_BACKWARD_TURNS, turn.name, blocks, backward=True)
    return names


def _order(
    candidate: Candidate, hardware: Hardware, workload: WorkloadSpec, profile: ModelProfile
) -> list[str]:
    """Every moment name the step can hold, in the order of the step's timeline: the first
    micro-batch, the later ones (``accumulating``), the last after skipped syncs
    (``synchronising``), the optimizer step, and the next step's forward (beside this step's
    gradients under Lightning's order, which zeroes them only before the next backward)."""
    blocks = 0 if candidate.one_unit else max(profile.block_count, 1)
    step = step_timeline(
        candidate, hardware, workload, blocks=blocks,
        params=float(profile.total_params), block_params=float(profile.block_params),
    )  # fmt: skip
    one = _micro_batch_names(step[0], blocks)
    order = one + [f"accumulating {n}" for n in one] + [f"synchronising {n}" for n in one]
    return [*order, "optimizer step", *(f"{n}, last step's gradients" for n in one)]


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
    moments = step_moments(t)
    moments.update(loop_moments(moments, profile, t.candidate, hardware, workload, t.acts))
    order = _order(t.candidate, hardware, workload, profile)
    events = [MemoryEvent(n, moments.pop(n)) for n in order if n in moments]
    assert not moments, f"moments with no place on the timeline: {sorted(moments)}"
    return events, t.host_bytes


def peak_event(events: list[MemoryEvent]) -> MemoryEvent:
    """The event with the most live bytes (the earliest of equals)."""
    return max(events, key=lambda e: e.live.total)
