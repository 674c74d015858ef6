"""emit/text: the optimizer the trials built, named where a stack's config has a key for it (the
Hugging Face Trainer's optim) and said where it has none (Lightning, accelerate)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from autoshard.config import Candidate
from tests.test_emit import candidate, make_rec


def hf(c: Candidate) -> dict[str, Any]:
    return json.loads(make_rec(c).to_yaml("hf-trainer"))


def test_the_trainer_builds_the_optimizer_the_trials_ran() -> None:
    assert hf(candidate())["optim"] == "adamw_torch"  # its default would be adamw_torch_fused
    assert hf(candidate(optimizer_impl="fused"))["optim"] == "adamw_torch_fused"
    sgd = hf(candidate(optimizer="sgd"))
    assert (sgd["optim"], sgd["optim_args"]) == ("sgd", "momentum=0.9")
    # what it has no name for is said, with the call that builds it
    adafactor = hf(candidate(optimizer="adafactor"))
    assert "optim" not in adafactor
    assert (
        "the Trainer has no optim name for torch.optim.Adafactor(foreach=True): pass "
        "Trainer(optimizer_cls_and_kwargs=(torch.optim.Adafactor, {'foreach': True}))"
    ) in adafactor["fsdp_config"]["autoshard"]["notes"]


def test_the_trainer_parses_the_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.test_handover import as_on_a_gpu_machine

    as_on_a_gpu_machine(monkeypatch)
    # SGD: its name and its momentum (test_config checks every row's name is the Trainer's)
    path = tmp_path / "hf.json"
    path.write_text(make_rec(candidate(optimizer="sgd")).to_yaml("hf-trainer"))
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    (args,) = parser.parse_json_file(str(path))
    assert (args.optim.value, args.optim_args) == ("sgd", "momentum=0.9")


def test_lightning_and_accelerate_say_an_optimizer_other_than_adamw() -> None:
    sgd = make_rec(candidate(optimizer="sgd"))
    line = "# optimizer: torch.optim.SGD(momentum=0.9, foreach=True), as the trials built it; "
    assert line + "configure_optimizers (or LightningCLI's optimizer: class_path) builds it" in (
        sgd.to_yaml("lightning")
    )
    assert line + "the script, before accelerator.prepare builds it" in sgd.to_yaml("accelerate")
    # torch.optim.AdamW's own default (foreach): nothing to say
    assert "# optimizer:" not in make_rec(candidate()).to_yaml("lightning")


def test_accelerate_keys_and_notes_word_for_word() -> None:
    from autoshard.emit.prose import describe_evidence
    from autoshard.emit.text import accelerate_config

    config, notes = accelerate_config(make_rec(candidate(limit_all_gathers=False)))
    assert config["fsdp_config"]["fsdp_use_orig_params"] is True  # the key accelerate reads
    assert notes[-1] == "set fsdp_plugin.limit_all_gathers = False in code (no config key)"
    # a decision that names no autoshard version says so by leaving it out
    unversioned = make_rec(candidate()).model_copy(update={"versions": {}})
    assert describe_evidence(unversioned)[0] == f"autoshard : {candidate().label()}"
