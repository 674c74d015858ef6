"""The worker's own logic (autoshard/trials/worker.py), no process started: the ranks' agreement on
a trial's outcome through a store, what a trial's result keeps, a failure in one line."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from autoshard.trials.accounting import summarize
from autoshard.trials.protocol import RankReport
from autoshard.trials.worker import agree
from tests.trials.test_protocol import _request


def _report(rank: int, ok: bool, at: float = 0.0) -> RankReport:
    if ok:
        return RankReport(rank=rank, status="ok", step_times=(0.1,), samples=2)
    return RankReport(rank=rank, status="error", error=f"E{rank}", failed_at=at)


def test_ranks_that_all_fail_go_on_together() -> None:
    store, outcomes = dist.HashStore(), {}

    def rank(r: int) -> None:
        time.sleep(0.3 * r)  # the second rank fails a little later
        outcomes[r] = agree(store, "t0", _report(r, ok=False), 2, timeout=5)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes == {0: True, 1: True}


def test_a_rank_that_fails_alone_knows_within_its_timeout() -> None:
    store = dist.HashStore()
    started = time.monotonic()
    assert agree(store, "t0", _report(1, ok=False), 2, timeout=0.5) is False  # rank 0 stuck
    assert 0.5 <= time.monotonic() - started < 2
    # a rank that finished the trial passed every collective: it does not wait
    started = time.monotonic()
    assert agree(store, "t1", _report(0, ok=True), 2, timeout=30) is True
    assert time.monotonic() - started < 1


def test_the_trials_result_keeps_the_first_failures_traceback_and_rank_0s_counts() -> None:
    from autoshard.measure import median_spread
    from autoshard.trials.worker import failure_path, published_failures, target_shape

    request = _request()
    # a failure whose time is unknown counts as the first; its traceback is the trial's
    unknown = RankReport(rank=1, status="error", error="E1", traceback="Traceback: one")
    timed = RankReport(rank=0, status="error", error="E0", traceback="Traceback: zero",
                       failed_at=0.5)  # fmt: skip
    reply = summarize(request, [timed, unknown])
    assert reply.error == "rank 1: E1" and reply.traceback == "Traceback: one"
    # every rank times the same steps: a mismatch is a bug, not something to average away
    uneven = [
        RankReport(rank=0, status="ok", step_times=(0.1, 0.2), samples=2),
        RankReport(rank=1, status="ok", step_times=(0.1,), samples=2),
    ]
    with pytest.raises(ValueError):
        summarize(request, uneven)
    # one rank: its own counts, spread, memory and losses
    times = (0.30, 0.20, 0.25, 0.26, 0.24, 0.27, 0.5)
    alone = RankReport(rank=0, status="ok", step_times=times, samples=4, tokens=256,
                       allocated=5, reserved=9, losses=(2.0, 1.5))  # fmt: skip
    reply = summarize(request, [alone])
    assert reply.step_time_spread == pytest.approx(median_spread(times)) and reply.step_time_spread
    assert reply.tokens_per_s == pytest.approx(256 / 0.26)
    assert (reply.peak_allocated, reply.peak_reserved) == ((5,), (9,))
    assert reply.losses == (2.0, 1.5)
    two = summarize(request, [alone, alone.model_copy(update={"rank": 1, "reserved": 11,
                                                              "losses": (9.0, 9.0)})])  # fmt: skip
    assert two.peak_reserved == (9, 11) and two.losses == (2.0, 1.5)  # rank 0's losses
    # where a failure is kept for the driver, what each rank published, what a warm-up keys on
    assert failure_path(Path("/c"), 3, 1) == Path("/c/failed-3-rank1.json")
    store = dist.HashStore()
    store.set("t/0", _report(0, ok=True).model_dump_json())
    store.set("t/2", _report(2, ok=False).model_dump_json())
    assert [r.rank for r in published_failures(store, "t", 3)] == [2]
    assert target_shape(request) == (request.target, request.candidate.precision, 2, 64)


def test_a_failure_is_one_line_naming_its_exception() -> None:
    from autoshard.trials.worker import _one_line

    assert _one_line(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert _one_line(RuntimeError("x" * 900)) == "RuntimeError: " + "x" * 486
    assert _one_line(KeyError()) == "KeyError:"
