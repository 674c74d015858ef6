"""A recommendation read back (autoshard/recommendation.py): load_result reads only its own study's
records."""

from __future__ import annotations

from pathlib import Path

from autoshard.config import Candidate, WorkloadSpec
from autoshard.results import TrialResult
from tests.test_study import HARDWARE


def test_load_result_reads_only_its_own_study(tmp_path: Path) -> None:
    from autoshard.recommendation import Recommendation, load_result
    from autoshard.results import ModelProfile, Scored
    from autoshard.study.journal import record_line

    mine = TrialResult(candidate=Candidate(micro_batch_size=1), status="ok")
    other = TrialResult(candidate=Candidate(micro_batch_size=2), status="ok")
    (tmp_path / "trials.jsonl").write_bytes(
        record_line("autoshard-b", other) + record_line("autoshard-a", mine)
    )
    rec = Recommendation(
        profile=ModelProfile(
            target="t", model_class="m", total_params=1, trainable_params=1, param_bytes=4
        ),
        hardware=HARDWARE,
        workload=WorkloadSpec(),
        chosen=Scored(candidate=mine.candidate, trial=mine),
        basis="trials",
        study="autoshard-a",
    )
    (tmp_path / "recommendation.json").write_text(rec.model_dump_json())
    assert load_result(tmp_path)[1] == [mine]
    # A recommendation written before studies were named reads every record.
    (tmp_path / "recommendation.json").write_text(
        rec.model_copy(update={"study": None}).model_dump_json()
    )
    assert len(load_result(tmp_path)[1]) == 2
