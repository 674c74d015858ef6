"""One training step of a candidate as memory over time: the memory events of the step
(:mod:`autoshard.predict.step_memory`, whose peak the memory estimate reports) placed on the
seconds the speed model gives the same turns (:func:`autoshard.predict.speed.turn_seconds`).

Each event takes the window of its FSDP unit's compute on the compute stream of the step's
schedule (events of one turn share it); the optimizer step (and CPU offload's copies and host
step, which the speed model adds whole) follows the last micro-batch. The walk emits a later
micro-batch's events once; here each micro-batch that holds them shows them, so a step of
``accumulate`` micro-batches has that many micro-batches' events; under Lightning's order the
first micro-batch's forward also runs beside the last step's gradients (the walk's next-step
events, placed there). What the speed model adds to the step off the turns (FSDP's copies,
float8's scale sync, the host-bound floor, memory pressure) is ``untimed``: the last event ends
at the step time less those seconds.
"""

from __future__ import annotations

from autoshard.predict.activations import ActivationProfile
from autoshard.predict.analytic import memory_events
from autoshard.predict.calibrate import SpeedModel
from autoshard.predict.factors import SpeedFactors
from autoshard.predict.speed import PassSeconds, turn_seconds, under_pressure
from autoshard.predict.speed_inputs import SpeedInputs
from autoshard.predict.step_memory import MemoryEvent, peak_event
from autoshard.predict.timeline import MicroBatch, Turn
from autoshard.results import MemoryEstimate, StepTimeline, TimedEvent

Timed = tuple[MicroBatch, PassSeconds, PassSeconds]


def _events_per_micro_batch(
    events: list[MemoryEvent], accumulate: int
) -> tuple[list[list[MemoryEvent]], list[MemoryEvent]]:
    """The walk's events as each of the step's micro-batches holds them, and the optimizer
    step's. The walk emits the first micro-batch, a later one (index 1: every later one holds
    the same) and, where the syncs were skipped, the last (its own reductions beside what the
    later ones hold); the next step's forward (Lightning's order) goes to the first's."""
    at = next(i for i, e in enumerate(events) if e.stage == "step")
    walked, step, following = events[:at], events[at : at + 1], events[at + 1 :]
    by_index: dict[int, list[MemoryEvent]] = {}
    for e in walked:
        by_index.setdefault(e.micro_batch, []).append(e)
    later = by_index.get(1, [])
    per = [by_index.get(0, []) + following] + [later] * (accumulate - 1)
    if accumulate > 2:  # at 2 the last is index 1 already
        per[-1] = later + by_index.get(accumulate - 1, [])
    return per, step


def _window(
    turn: Turn | None, turns: tuple[Turn, ...], seconds: PassSeconds
) -> tuple[float, float]:
    """``turn``'s window in its pass; the whole pass where the speed model's turns differ (a
    model without blocks: one unit for the speed model, root and block for the walk)."""
    for i, t in enumerate(turns):
        if turn is not None and t.name == turn.name:
            return seconds.windows[i]
    return (seconds.windows[0][0], seconds.windows[-1][1]) if seconds.windows else (0.0, 0.0)


def _schedule_of(schedule: list[Timed], accumulate: int) -> list[Timed]:
    """The timed micro-batch each of the step's micro-batches runs as: after skipped syncs the
    ones before the last do not reduce, the last does."""
    reducing = next(m for m in schedule if m[0].reduces)
    kept = next((m for m in schedule if not m[0].reduces), reducing)
    return [reducing if j == accumulate - 1 else kept for j in range(accumulate)]


def _placed(
    per_micro_batch: list[list[MemoryEvent]], schedule: list[Timed]
) -> tuple[list[tuple[MemoryEvent, TimedEvent]], float]:
    """Each micro-batch's events on its turns' windows, and when the last micro-batch ends."""
    out: list[tuple[MemoryEvent, TimedEvent]] = []
    clock = 0.0
    for j, (events, (mb, forward, backward)) in enumerate(
        zip(per_micro_batch, schedule, strict=True)
    ):
        for e in events:
            before = e.stage == "forward"
            turns, seconds = (mb.forward, forward) if before else (mb.backward, backward)
            start, end = _window(e.turn, turns, seconds)
            offset = clock + (0.0 if before else forward.elapsed)
            turn = e.turn.name if e.turn is not None else None
            timed = TimedEvent(
                name=e.name, stage=e.stage, micro_batch=j, turn=turn,
                start_s=offset + start, end_s=offset + end, live=e.live,
            )  # fmt: skip
            out.append((e, timed))
        clock += forward.elapsed + backward.elapsed
    return out, clock


def step_profile(
    speed: SpeedModel,
    estimate: MemoryEstimate,
    activations: ActivationProfile,
    factors: SpeedFactors | None = None,
    *,
    calibrated: bool = False,
) -> StepTimeline:
    """The step of ``estimate``'s candidate as memory over time: its memory events (from
    ``activations``, as :func:`~autoshard.predict.analytic.estimate_memory` walks them) in time
    order, on ``speed``'s seconds with ``factors`` (its prior when None), the peak marked.
    One candidate's: a few milliseconds, for the candidate a report shows."""
    profile, hardware, workload = speed.profile, speed.hardware, speed.workload
    candidate, accumulate = estimate.candidate, workload.accumulate
    factors = factors or speed.prior
    events = memory_events(profile, candidate, hardware, workload, activations=activations)
    inputs = SpeedInputs(
        profile, speed.flops, hardware, workload, factors, gpu=speed.gpu, linears=speed.linears
    )
    schedule = turn_seconds(inputs, candidate)
    per_micro_batch, step = _events_per_micro_batch(events, accumulate)
    placed, end = _placed(per_micro_batch, _schedule_of(schedule, accumulate))
    predicted = speed.predict(candidate, factors)
    predicted = under_pressure(predicted, estimate.gpu_peak, estimate.gpu_peak + estimate.headroom)
    b = predicted.breakdown
    for e in step:  # the optimizer step, and offload's copies and host step, after the last
        tail = end + b.optimizer_s + b.offload_s
        placed.append((e, TimedEvent(name=e.name, stage="step", micro_batch=accumulate - 1,
                                     turn=None, start_s=end, end_s=tail, live=e.live)))  # fmt: skip
    placed.sort(key=lambda pair: pair[1].start_s)  # stable: a turn's events in the walk's order
    peak = peak_event(events)
    return StepTimeline(
        candidate=candidate.label(),
        events=tuple(timed for _, timed in placed),
        peak=next(i for i, (e, _) in enumerate(placed) if e is peak),
        step_time_s=predicted.step_time_s,
        untimed={
            "FSDP's copies": b.distributed_s,
            "float8 scale sync": b.float8_scale_sync_s,
            "host-bound floor": b.host_bound_s,
            "memory pressure": b.pressure_s,
        },
        calibrated=calibrated,
    )
