"""The outcome table (autoshard.outcomes): every trial status falls under exactly one row, in the
one word every view says, and a status without a row of its own counts as failed."""

from __future__ import annotations

import pytest

from autoshard import outcomes
from autoshard.outcomes import OUTCOMES, Outcome, TrialStatus, outcome_of


def test_every_status_falls_under_exactly_one_outcome() -> None:
    for status in TrialStatus:
        rows = [o for o in OUTCOMES if status in o.statuses]
        assert len(rows) == 1, status
        assert outcome_of(status) is rows[0]
    assert [o.word for o in OUTCOMES] == ["measured", "diverged", "failed", "skipped", "ruled out"]
    assert len({o.colour for o in OUTCOMES}) == len({o.mark for o in OUTCOMES}) == len(OUTCOMES)


def test_only_pruned_and_skipped_candidates_never_launched() -> None:
    never = {s for s in TrialStatus if not s.launched}
    assert never == {TrialStatus.PRUNED, TrialStatus.SKIPPED}
    # and those are the outcomes a table says were never launched
    assert {outcome_of(s).word for s in never} == {"skipped", "ruled out"}


def test_a_status_without_a_row_of_its_own_counts_as_failed(monkeypatch: pytest.MonkeyPatch):
    without_oom = tuple(
        o._replace(statuses=tuple(s for s in o.statuses if s is not TrialStatus.OOM))
        for o in OUTCOMES
    )
    monkeypatch.setattr(outcomes, "OUTCOMES", without_oom)
    assert outcome_of(TrialStatus.OOM).word == "failed"
    assert outcome_of(TrialStatus.OK).word == "measured"
    assert isinstance(outcome_of(TrialStatus.DIVERGED), Outcome)
