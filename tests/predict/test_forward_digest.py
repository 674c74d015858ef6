"""A study's name covers what its trials measure: an edited forward starts a new study, with one
line saying so, like a changed structure does (issue 36)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autoshard.options import PlanOptions, TuneOptions
from autoshard.plan import make_plan, make_request
from autoshard.search import study_settings
from autoshard.study.journal import read_records

from ..conftest import ROOT

SOURCE = (ROOT / "tests" / "targets" / "faults.py").read_text()
ONCE = "            x = block(x)\n"
TWICE = "            x = block(block(x))\n"


def edited(folder: Path, name: str, line: str) -> str:
    assert ONCE in SOURCE
    path = folder / f"{name}.py"
    path.write_text(SOURCE.replace(ONCE, line))
    return f"{path}:build"


def settings_of(target: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        options = PlanOptions(gpus=2, gpu_memory="4GiB", seq_len=16, batch_size=(1,))
        plan = make_plan(make_request(target, options, trials=True))
    return study_settings(plan, TuneOptions())


def test_an_edited_forward_names_another_study(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    once = settings_of(edited(tmp_path / "a", "model", ONCE))
    again = settings_of(edited(tmp_path / "a", "model", ONCE))
    twice = settings_of(edited(tmp_path / "b", "model", TWICE))
    assert once.computation and once.computation == again.computation
    assert once.model == twice.model  # the same parameters: the structure did not change
    # the same target string, edited in between
    twice = twice.model_copy(update={"target": once.target})
    assert once.name() != twice.name()
    assert twice.differences(once) == ["the model's forward (what it computes, traced)"]


@pytest.mark.slow
def test_an_edited_forward_is_measured_again(tmp_path: Path) -> None:
    """The same command on the same --out after `x = block(x)` became `x = block(block(x))`:
    a new study, one line saying the forward changed, nothing resumed."""
    model = tmp_path / "model.py"
    model.write_text(SOURCE)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "autoshard", "tune", f"{model}:build", "--seq-len", "16",
               "--gpu-memory", "4GiB", "--precision", "32-true", "--batch-size", "1",
               "--trials", "1", "--warmup", "1", "--steps", "2", "--max-steps", "3",
               "--out", str(out), "--json"]  # fmt: skip

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400)

    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    model.write_text(SOURCE.replace(ONCE, TWICE))
    second = run()
    assert second.returncode == 0, second.stderr[-3000:]
    notes = [line for line in second.stderr.splitlines() if "new study" in line]
    assert len(notes) == 1 and "the model's forward" in notes[0], second.stderr
    studies = [json.loads(r.stdout)["study"] for r in (first, second)]
    assert studies[0] != studies[1]
    measured = [[r for r in read_records(out / "trials.jsonl", s) if r.status.launched]
                for s in studies]  # fmt: skip
    assert [len(m) for m in measured] == [1, 1]
