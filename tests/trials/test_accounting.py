"""A trial's result accounting (autoshard.trials.accounting), no process started: tokens,
samples, status precedence."""

from __future__ import annotations

import pytest

from autoshard.config import Candidate, WorkloadSpec
from autoshard.results import TrialStatus
from autoshard.target.resolve import TargetSpec
from autoshard.trials.accounting import summarize
from autoshard.trials.protocol import RankReport, TrialRequest
from tests.trials.test_protocol import _request
from tests.trials.test_worker import _report


def test_an_oom_on_one_rank_is_the_trials_status_whatever_the_others_raised() -> None:
    # rank 1 runs out of memory, rank 0 then raises (its collective broke): the trial is an OOM,
    # which the OOM dominance rule and the failure lessons read; an error would hide it
    request = _request()
    oom = RankReport(rank=1, status="oom", error="OutOfMemoryError: CUDA", failed_at=10.0)
    later = RankReport(rank=0, status="error", error="RuntimeError: gloo", failed_at=12.0)
    earlier = later.model_copy(update={"failed_at": 5.0})
    for reports in ([later, oom], [oom, later], [earlier, oom]):
        reply = summarize(request, reports)
        assert reply.status is TrialStatus.OOM, reports
        assert reply.error == "rank 1: OutOfMemoryError: CUDA"
    # two OOMs: the first is the cause
    second = oom.model_copy(update={"rank": 0, "failed_at": 11.0, "error": "OOM later"})
    assert summarize(request, [second, oom]).error == "rank 1: OutOfMemoryError: CUDA"
    # one rank failing fails the trial, however well the others ran
    fine = RankReport(rank=0, status="ok", step_times=(0.1,), samples=2, tokens=128)
    assert summarize(request, [fine, oom]).status is TrialStatus.OOM
    assert summarize(request, [fine, later.model_copy(update={"rank": 1})]).status is (
        TrialStatus.ERROR
    )


def test_a_trials_tokens_are_its_samples_times_the_sequence_length() -> None:
    """What a rank counts in a timed step (trials.accounting.step_counts) and what the trial
    reports from every rank's counts: tokens/s = samples/s x seq_len, at any micro-batch."""
    import torch

    from autoshard.trials.accounting import step_counts

    seq_len, world = 64, 2
    for micro_batch, accumulate in ((1, 1), (4, 1), (4, 3)):
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        samples, tokens = step_counts(ids, accumulate)
        assert (samples, tokens) == (micro_batch * accumulate, micro_batch * accumulate * seq_len)
        assert step_counts({"input_ids": ids, "labels": ids}, accumulate) == (samples, tokens)
        reports = [
            RankReport(
                rank=r, status="ok", step_times=(0.2, 0.25, 0.3), samples=samples, tokens=tokens
            )
            for r in range(world)
        ]
        reply = summarize(_request(), reports)
        assert reply.step_time == pytest.approx(0.25)
        assert reply.samples_per_s == pytest.approx(world * micro_batch * accumulate / 0.25)
        assert reply.tokens_per_s == pytest.approx(reply.samples_per_s * seq_len)
    # not a token batch (images): samples only
    assert step_counts(torch.randn(3, 3, 8, 8), 2) == (6, None)


def test_an_error_says_how_many_ranks_raised_it() -> None:
    """The model's own error is deterministic: every rank raises it. One rank's error, the
    others failing on the broken collective, is counted as raised by one (study/causes reads
    it: only an error every rank raised counts against the configuration)."""
    request = _request()
    own = [RankReport(rank=r, status="error", error="ValueError: bad shape", failed_at=1.0 + r)
           for r in range(2)]  # fmt: skip
    assert summarize(request, own).raised_on == 2
    alone = RankReport(rank=1, status="error", error="ValueError: bad row 7", failed_at=1.0)
    broken = RankReport(rank=0, status="error", error="RuntimeError: Connection closed by peer",
                        failed_at=2.0)  # fmt: skip
    reply = summarize(request, [broken, alone])
    assert reply.error == "rank 1: ValueError: bad row 7" and reply.raised_on == 1
    oom = RankReport(rank=0, status="oom", error="OutOfMemoryError: CUDA", failed_at=1.0)
    assert summarize(request, [oom, alone]).raised_on is None  # an OOM is no model error


def test_the_first_failure_is_the_trials_error_whichever_rank() -> None:
    request = TrialRequest(n=0, candidate=Candidate(), target=TargetSpec(spec="m:b"),
                           workload=WorkloadSpec())  # fmt: skip
    reply = summarize(request, [_report(0, ok=False, at=20.0), _report(1, ok=False, at=10.0)])
    assert reply.status is TrialStatus.ERROR and reply.error == "rank 1: E1"
    ok = summarize(
        request,
        [
            RankReport(rank=0, status="ok", step_times=(0.1, 0.3), samples=2, allocated=5),
            RankReport(rank=1, status="ok", step_times=(0.2, 0.1), samples=2, allocated=7),
        ],
    )
    assert ok.step_times == (0.2, 0.3) and ok.peak_allocated == (5, 7)
    assert ok.samples_per_s == pytest.approx(4 / 0.25)
