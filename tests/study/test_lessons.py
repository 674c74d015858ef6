"""What failures teach (autoshard/study/lessons.py): an error rules out larger micro-batches, a
shared setting, or stops the study; hangs and timeouts; a failure's signature; lessons about
candidates outside the space. Trials are a function here (tests/test_study.py's Runner)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoshard.config import Candidate
from autoshard.errors import TrialsFailedError
from autoshard.results import TrialResult, TrialStatus
from autoshard.study.dominance import dominated_by
from autoshard.study.lessons import learn

from ..test_study import Runner, journal, space, study


def test_an_error_rules_out_the_larger_micro_batches_of_that_configuration() -> None:
    cands = space()
    failed = next(c for c in cands if c.micro_batch_size == 2)
    result = TrialResult(candidate=failed, status="error", error="RuntimeError: shape [2, 8]")
    untried = {c.label() for c in cands} - {failed.label()}
    lessons = learn(cands, [result], untried)
    assert set(lessons.ruled_out) == {failed.model_copy(update={"micro_batch_size": 4}).label()}
    assert list(lessons.ruled_out.values()) == [
        f"{failed.label()} failed (error: RuntimeError: shape [2, 8]): the same configuration "
        "with a larger micro-batch would too"
    ]
    # Nothing ran fine yet: the next trial should have as few of its settings as it can.
    from autoshard.study.lessons import properties

    same, least = lessons.suspects
    assert least == 2 and same == {
        n: v for n, v in properties(failed).items() if n in ("sharding", "precision")
    }


def test_the_same_error_twice_rules_out_the_shared_setting() -> None:
    cands = space()
    bf16 = [c for c in cands if c.precision.value == "bf16-mixed"]
    fails = [
        TrialResult(candidate=bf16[0], status="error", error="RuntimeError: bf16 at step 1"),
        TrialResult(candidate=bf16[4], status="error", error="RuntimeError: bf16 at step 3"),
    ]
    fine = TrialResult(candidate=cands[0], status="ok")  # an fp32 one ran
    untried = {c.label() for c in cands} - {r.candidate.label() for r in [*fails, fine]}
    lessons = learn(cands, [*fails, fine], untried)
    assert set(lessons.ruled_out) == {c.label() for c in bf16} - {
        r.candidate.label() for r in fails
    }
    assert any("precision=bf16-mixed" in why for why in lessons.ruled_out.values())
    # A configuration with that setting ran fine: the setting is not the cause.
    bf16_fine = TrialResult(candidate=bf16[8], status="ok")
    lessons = learn(cands, [*fails, bf16_fine], untried - {bf16[8].label()})
    assert all("precision" not in why for why in lessons.ruled_out.values())


def test_the_same_error_on_configurations_that_share_nothing_stops_the_study() -> None:
    cands = space()
    a = Candidate(sharding="NO_SHARD", precision="32-true", micro_batch_size=1)
    b = Candidate(sharding="FULL_SHARD", precision="bf16-mixed", micro_batch_size=1)
    fails = [
        TrialResult(candidate=a, status="error", error="ValueError: bad batch key 'x' (1)"),
        TrialResult(candidate=b, status="error", error="ValueError: bad batch key 'x' (2)"),
    ]
    with pytest.raises(TrialsFailedError, match=r"share no setting.*bad batch key"):
        learn(cands, fails, {c.label() for c in cands} - {a.label(), b.label()})
    # ... unless something ran fine: then the error depends on the configuration.
    ok = TrialResult(candidate=cands[1], status="ok")
    learn(cands, [*fails, ok], set())


def test_the_same_cause_reported_by_other_ranks_and_launches_is_one_failure() -> None:
    """Issue 25, case 6: the same exit, seen on rank 1 then on rank 0, with another control
    folder each launch, is the same error: the study stops after these two trials."""
    cands = space()
    a = Candidate(sharding="NO_SHARD", precision="32-true", micro_batch_size=1)
    b = Candidate(sharding="FULL_SHARD", precision="bf16-mixed", micro_batch_size=1)
    said = "error: unrecognized arguments: --control /o/workers/group-{}"
    fails = [
        TrialResult(candidate=a, status="error", error=f"rank 1: SystemExit: exit code 2, called "
                    f"at model.py:9 in build ({said.format('1-3fa9c2')})"),
        TrialResult(candidate=b, status="error", error=f"rank 0: SystemExit: exit code 2, called "
                    f"at model.py:9 in build ({said.format('2-e07b1d')})"),
    ]  # fmt: skip
    with pytest.raises(TrialsFailedError, match=r"unrecognized arguments.*fix the model"):
        learn(cands, fails, {c.label() for c in cands} - {a.label(), b.label()})


def test_timeouts_everywhere_advise_a_longer_trial_timeout() -> None:
    from autoshard.decide import nothing_ran

    cands = space()
    why = "no result after 1.0 s (trial timeout 1 s); the worker group was killed"
    a = Candidate(sharding="NO_SHARD", precision="32-true", micro_batch_size=1)
    b = Candidate(sharding="FULL_SHARD", precision="bf16-mixed", micro_batch_size=1)
    fails = [TrialResult(candidate=c, status="timeout", error=why) for c in (a, b)]
    with pytest.raises(TrialsFailedError, match=r"raise --trial-timeout \(1 s\) if a trial needs"):
        learn(cands, fails, {c.label() for c in cands} - {a.label(), b.label()})
    assert "raise --trial-timeout (1 s)" in nothing_ran(fails)
    errors = [
        TrialResult(candidate=f.candidate, status="error", error="ValueError: x") for f in fails
    ]
    assert "--trial-timeout" not in nothing_ran(errors) and "fix the model" in nothing_ran(errors)


def test_a_model_that_always_fails_stops_after_two_trials(tmp_path: Path) -> None:
    def always(c: Candidate, n: int) -> TrialResult:
        return TrialResult(candidate=c, status="error", error=f"KeyError: 'labels' (rank {n})")

    runner = Runner(always)
    with pytest.raises(TrialsFailedError, match="KeyError"):
        study(tmp_path, space(), runner, n_trials=12)
    assert len(runner.calls) == 2  # the second is a probe unlike the first
    # The stop is recorded: the next run stops at once, running nothing.
    again = Runner(always)
    with pytest.raises(TrialsFailedError):
        study(tmp_path, space(), again, n_trials=12)
    assert again.calls == []


def test_a_hang_at_one_micro_batch_costs_few_trials(tmp_path: Path) -> None:
    def hangs_from_4(c: Candidate, n: int) -> TrialResult | None:
        if c.micro_batch_size >= 4:
            return TrialResult(candidate=c, status="timeout", error="no result within 20 s")
        return None

    # Largest micro-batch first (as the estimator ranks them: faster per sample).
    cands = sorted(space(), key=lambda c: -c.micro_batch_size)
    runner = Runner(hangs_from_4)
    _, results = study(tmp_path, cands, runner, n_trials=12, dominated=dominated_by)
    hangs = [label for label in runner.calls if "mbs4" in label]
    # Two hangs at fp32 teach "32-true, micro-batch >= 4"; a third at bf16 "micro-batch >= 4":
    # 3 of the 6 candidates at micro-batch 4 run (it was 5 of 6 trials before).
    assert len(hangs) == 3, runner.calls
    skipped = [r for r in results if r.status is TrialStatus.SKIPPED]
    assert {r.candidate.micro_batch_size for r in skipped} == {4} and len(skipped) == 3
    assert any("micro-batch >= 4" in (r.error or "") for r in skipped)
    assert len(runner.calls) == 12  # the cap is spent on the micro-batches that run
    # Skips are recorded with their reason, in the journal too.
    assert {r.candidate.label() for r in journal(tmp_path) if r.status is TrialStatus.SKIPPED} == {
        r.candidate.label() for r in skipped
    }


def test_hangs_are_one_failure_whatever_their_message_says() -> None:
    # A timeout's detail is the workers' last log line, e.g. an earlier trial's error (seen in
    # benchmarks/faults_study.py): two hangs still teach together.
    cands = space()
    a, b = [c for c in cands if c.micro_batch_size == 4 and c.precision.value == "32-true"][:2]
    hangs = [
        TrialResult(candidate=a, status="timeout", error="no result after 15.1 s; killed"),
        TrialResult(
            candidate=b, status="timeout", error="no result after 15.0 s; killed: RuntimeError: x"
        ),
    ]
    ok = TrialResult(candidate=cands[0], status="ok")  # 32-true, micro-batch 1
    untried = {c.label() for c in cands} - {a.label(), b.label(), ok.candidate.label()}
    ruled = learn(cands, [*hangs, ok], untried).ruled_out
    assert any("micro-batch >= 4" in why for why in ruled.values()), ruled


def test_a_failures_signature_blanks_its_numbers_and_keeps_its_words() -> None:
    from autoshard.study.lessons import describe, signature

    def failed(error: str | None) -> TrialResult:
        return TrialResult(candidate=Candidate(), status=TrialStatus.ERROR, error=error)

    text = "RuntimeError: Bad  shape at 0x7F3A in step 12,\n3.5 GiB on rank 1"
    assert (
        signature(failed(text)) == "error: runtimeerror: bad shape at # in step #, # gib on rank #"
    )
    assert signature(failed(text.replace("12", "99"))) == signature(failed(text))
    assert signature(failed(None)) == "error: "
    assert signature(failed("word " * 100)) == "error: " + ("word " * 100)[:240]
    assert describe({"precision": "32-true", "wrap": "none"}, 4) == (
        "precision=32-true, wrap=none, micro-batch >= 4"
    )
    assert describe({"precision": "32-true"}, None) == "precision=32-true"


def test_a_failure_outside_the_candidates_still_rules_out_its_larger_batches() -> None:
    # a failure recorded by an earlier study whose space held micro-batch 1: the same
    # configuration at a larger micro-batch is ruled out here too
    cands = [Candidate(precision="32-true", micro_batch_size=m) for m in (2, 4)]
    gone = Candidate(precision="32-true", micro_batch_size=1)
    bad = TrialResult(candidate=gone, status=TrialStatus.ERROR, error="RuntimeError: shape")
    lessons = learn(cands, [bad], [c.label() for c in cands])
    assert sorted(lessons.ruled_out) == sorted(c.label() for c in cands)


def test_a_failure_is_quoted_short_and_a_configuration_is_not_its_own_larger_batch() -> None:
    from autoshard.study.lessons import _short, _Space

    def failed(status: TrialStatus, error: str | None) -> TrialResult:
        return TrialResult(candidate=Candidate(), status=status, error=error)

    assert _short(failed(TrialStatus.TIMEOUT, None)) == "timeout"
    assert _short(failed(TrialStatus.ERROR, "RuntimeError:  bad\nshape")) == (
        "error: RuntimeError: bad shape"
    )
    long = "x" * 200
    assert _short(failed(TrialStatus.ERROR, long)) == "error: " + "x" * 117 + "..."
    assert _short(failed(TrialStatus.ERROR, "y" * 120)) == "error: " + "y" * 120
    small, big = Candidate(micro_batch_size=1), Candidate(micro_batch_size=2)
    space = _Space([small, big])
    assert space.larger_batch_of(big, small) and not space.larger_batch_of(small, small)
    assert not space.larger_batch_of(small, big)


def test_what_lessons_compare_and_advise_word_for_word() -> None:
    """A candidate's properties as the lessons compare and print them, a failure's cause with
    its paths left out, and the timeout advice naming the first failure's limit (mutation
    survivors of study/lessons, killed)."""
    from autoshard.config import Checkpointing, Sharding
    from autoshard.study.lessons import advice, cause, properties

    hybrid = Candidate(
        sharding=Sharding.HYBRID_SHARD, hybrid_mesh=(2, 4), wrap_classes=("a.Block", "a.Head"),
        checkpointing=Checkpointing.EVERY_K, checkpoint_every=2, checkpoint_classes=("a.Block",),
    )  # fmt: skip
    props = properties(hybrid)
    assert props["sharding"] == "HYBRID_SHARD 2x4"
    assert props["checkpointing"] == "every 2"
    assert props["wrap"] == "a.Block,a.Head"
    assert cause("rank 0: FileNotFoundError: /tmp/x/y.pt missing") == (
        "filenotfounderror: <path> missing"
    )
    timeouts = [
        TrialResult(candidate=Candidate(), status="timeout", error=f"no result after {t} s "
                    f"(trial timeout {t} s)")
        for t in (7, 9)
    ]  # fmt: skip
    assert advice(timeouts).startswith("raise --trial-timeout (7 s) if a trial needs longer")
