"""What optuna-dashboard shows of a study (autoshard.study.knobs): one parameter per knob, the
default objective per rank, the recommended trial's attribute."""

from __future__ import annotations

from autoshard.config import Candidate
from autoshard.results import TrialResult, TrialStatus
from autoshard.study.knobs import KNOBS, knob_distributions, knobs_of, measured_per_rank


def test_every_knob_is_a_parameter_and_its_choices_are_the_candidates_values() -> None:
    a = Candidate(precision="32-true", micro_batch_size=1)
    b = Candidate(precision="bf16-mixed", micro_batch_size=4, cpu_offload=True)
    assert set(knobs_of(a)) == set(KNOBS)
    every2 = Candidate(checkpointing="every_k", checkpoint_every=2, checkpoint_classes=("x.B",))
    assert knobs_of(every2)["checkpointing"] == "every_2"
    choices = knob_distributions([b, a])
    assert choices["micro_batch"].choices == (1, 4)
    assert choices["precision"].choices == ("32-true", "bf16-mixed")
    assert choices == knob_distributions([a, b])  # the same candidates: the same choices


def test_the_default_objective_is_one_ranks_rate() -> None:
    c = Candidate()
    tokens = TrialResult(candidate=c, status=TrialStatus.OK, world_size=4, tokens_per_s=800.0,
                         samples_per_s=2.0)  # fmt: skip
    assert measured_per_rank(tokens) == 200.0  # tokens/s first
    samples = tokens.model_copy(update={"tokens_per_s": None})
    assert measured_per_rank(samples) == 0.5
