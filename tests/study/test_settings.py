"""The study's settings and name (autoshard/study/settings.py): the name follows every setting and
ignores order; changed settings or a changed model start a new study, the same ones resume.
Trials are a function here (tests/test_study.py's Runner)."""

from __future__ import annotations

from pathlib import Path

from autoshard.config import Engine, WorkloadSpec
from autoshard.study.settings import StudySettings
from autoshard.target.resolve import TargetSpec

from ..test_study import GIB, HARDWARE, TARGET, Runner, journal, settings, space, study


def test_the_name_follows_every_setting_and_ignores_order() -> None:
    base = settings()
    assert base.name() == settings(sizes=(4, 2, 1), precisions=("bf16-mixed", "32-true")).name()
    assert base.name() == settings(sizes=(1, 1, 2, 4)).name()  # duplicates
    changed = [
        settings(sizes=(1,)),
        settings(precisions=("32-true",)),
        base.model_copy(update={"hardware": HARDWARE.model_copy(update={"gpus_per_node": 4})}),
        base.model_copy(update={"workload": WorkloadSpec(seq_len=16)}),
        base.model_copy(update={"workload": WorkloadSpec(seq_len=8, loop="plain")}),
        base.model_copy(update={"workload": WorkloadSpec(seq_len=8, accumulate=4)}),
        base.model_copy(update={"engine": Engine.FSDP2}),
        base.model_copy(update={"target": TARGET.model_copy(update={"kwargs": {"size": "s"}})}),
        base.model_copy(update={"memory_cap": GIB}),
    ]
    names = {s.name() for s in changed} | {base.name()}
    assert len(names) == len(changed) + 1
    assert base.name(["a", "b"]) != base.name(["a"])  # another candidate set


def test_changed_settings_start_a_new_study_and_the_same_resume(tmp_path: Path) -> None:
    cands = space(sizes=(1, 2))
    first = Runner()
    name_a, _ = study(tmp_path, cands, first, n_trials=3, sett=settings(sizes=(1, 2)))
    assert len(first.calls) == 3

    # --batch-size 1 after 1,2: a new study; nothing measured at micro-batch 2 is reused.
    only_1 = [c for c in cands if c.micro_batch_size == 1]
    second = Runner()
    name_b, results_b = study(tmp_path, only_1, second, n_trials=2, sett=settings(sizes=(1,)))
    assert name_b != name_a
    assert len(second.calls) == 2
    assert {r.candidate.micro_batch_size for r in results_b} == {1}
    assert len(journal(tmp_path, name_b)) == 2 and len(journal(tmp_path, name_a)) == 3

    # The same settings again: resumed, nothing run twice.
    again = Runner()
    name_c, results_c = study(tmp_path, only_1, again, n_trials=2, sett=settings(sizes=(1,)))
    assert name_c == name_b and again.calls == []
    assert [r.started_at for r in results_c] == [r.started_at for r in results_b]


def test_a_changed_model_starts_a_new_study_and_says_so(tmp_path: Path) -> None:
    """The same factory and arguments, the model edited in between (issue 25, case 1): its
    structure is part of the name; the old trials are not resumed, and one line says why."""
    from torch import nn

    from autoshard.study.settings import model_fingerprint

    def of(width: int, target: TargetSpec = TARGET) -> StudySettings:
        model = nn.Sequential(nn.Embedding(64, width), nn.Linear(width, 64))
        sizes, precisions = (1, 2), ("32-true", "bf16-mixed")
        return StudySettings.of(target, HARDWARE, WorkloadSpec(seq_len=8), precisions=precisions,
                                micro_batch_sizes=sizes).with_model(model)  # fmt: skip

    assert of(16).model == model_fingerprint(nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64)))
    cands = space(sizes=(1, 2))
    first = Runner()
    name_a, _ = study(tmp_path, cands, first, n_trials=2, sett=of(16))
    wider, said = Runner(), []
    name_b, results = study(tmp_path, cands, wider, n_trials=2, sett=of(32), notices=said)
    assert name_b != name_a and len(wider.calls) == 2  # measured again, nothing resumed
    assert [r.started_at for r in results] == [r.started_at for r in journal(tmp_path, name_b)]
    changed = [line for line in said if "new study" in line]
    assert len(changed) == 1 and name_a in changed[0], said
    assert "the model (2,112 -> 4,160 parameters) changed" in changed[0]
    # Another target in the same folder says so.
    other = TargetSpec(spec="other/model.py:build")
    said.clear()
    study(tmp_path, cands, Runner(), n_trials=1, sett=of(32, other), notices=said)
    assert any("of another target (examples/gpt.py" in line for line in said), said
    # The same model again: resumed, without a line.
    said.clear()
    again = Runner()
    study(tmp_path, cands, again, n_trials=1, sett=of(32, other), notices=said)
    assert again.calls == [] and not said
