"""The tuning study end to end: real gloo trials, pruning by estimate, resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import warnings

import pytest

from autoshard.analyze import analyze_target
from autoshard.api import tune
from autoshard.config import Hardware, Precision, WorkloadSpec
from autoshard.predict.activations import profile_activations
from autoshard.predict.analytic import estimate_all
from autoshard.ranking import ranked, trial_contender
from autoshard.results import Decision, TrialResult, TrialStatus
from autoshard.space import Knobs, enumerate_candidates
from autoshard.ui.files import DATABASE_FILE

from .conftest import EXAMPLES, ROOT

GIB = 1024**3


def read_trials(path) -> list[dict]:
    """trials.jsonl's records, without the name of the study each belongs to."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k != "study"} for r in records]


@pytest.mark.slow
def test_study_prunes_by_estimate_and_picks_the_fastest_measured(tmp_path, examples_gpt_tiny):
    workload = WorkloadSpec(seq_len=32)
    profile, built = analyze_target(examples_gpt_tiny)
    acts = profile_activations(built.model, profile, workload)
    probe = Hardware(gpus_per_node=2, gpu_memory=80 * GIB, backend="gloo")
    cands = enumerate_candidates(profile, probe, workload, Knobs(precisions=(Precision.FP32,)))
    estimates = estimate_all(profile, cands, probe, workload, activations=acts)
    # A GPU just big enough for the three smallest candidates without offload (FSDP1's CPU
    # offload cannot run on a CPU-only torch): the others must be pruned, never launched.
    peaks = sorted(e.gpu_peak for e in estimates if not e.candidate.cpu_offload)
    memory = int((peaks[2] + 1) / 0.95) + 1
    options = dict(
        gpus=2, gpu="cpu-gloo", gpu_memory=memory, precision="32-true", seq_len=32,
        batch_size=1, trials=3,
        out_dir=tmp_path, memory_cap=4 * GIB,
    )  # fmt: skip
    rec = tune(examples_gpt_tiny, **options)

    trials = read_trials(tmp_path / "trials.jsonl")
    pruned = [t for t in trials if t["status"] == "pruned"]
    ok = [t for t in trials if t["status"] == "ok"]
    assert pruned and all("GiB per GPU" in t["error"] for t in pruned)
    assert 1 <= len(ok) <= 3
    # the decision's rule on what was measured (decide.ranked)
    results = [TrialResult.model_validate(t) for t in ok]
    usable = rec.hardware.usable_gpu_memory
    best = ranked([trial_contender(r, usable) for r in results])[0].item
    assert rec.basis == "trials"
    assert rec.chosen.trial == best
    assert all(t["step_time_spread"] is not None for t in ok)
    assert rec.chosen.estimate is not None and rec.chosen.estimate.fits
    assert {s.candidate.label() for s in rec.ruled_out} >= {json_label(t) for t in pruned}
    assert json.loads((tmp_path / "recommendation.json").read_text())["basis"] == "trials"
    # one step time for the chosen configuration, calibrated by the trials before it or not
    predicted = rec.chosen.estimate.speed
    assert rec.timeline is not None and rec.timeline.calibrated == predicted.calibrated
    assert rec.timeline.step_time_s == pytest.approx(predicted.step_time_s, rel=1e-9)
    # Pruned candidates were never launched: one worker group for the whole study.
    assert len(list((tmp_path / "workers").glob("group-*.log"))) == 1

    # The same study again: everything is finished, nothing is launched or rerun.
    again = tune(examples_gpt_tiny, **options)
    assert again.chosen.candidate == rec.chosen.candidate
    assert len(read_trials(tmp_path / "trials.jsonl")) == len(trials)
    assert len(list((tmp_path / "workers").glob("group-*.log"))) == 1


def json_label(trial: dict) -> str:
    from autoshard.config import Candidate

    return Candidate.model_validate(trial["candidate"]).label()


@pytest.mark.slow
def test_killed_study_resumes_without_rerunning(tmp_path) -> None:
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "autoshard", "tune", f"{EXAMPLES}/gpt.py:build",
        "--arg", "size=tiny", "--seq-len", "32", "--gpu-memory", "4GiB", "--precision", "32-true",
        "--trials", "3", "--out", str(out), "--steps", "2", "--warmup", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    log = out / "trials.jsonl"
    deadline = time.monotonic() + 240
    while not (log.exists() and any(t["status"] == "ok" for t in read_trials(log))):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "no trial finished in time"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up, as with `kill -9` or a crash
    proc.wait()
    before = read_trials(log)

    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    after = read_trials(log)
    launched = [json_label(t) for t in after if TrialStatus(t["status"]).launched]
    assert len(launched) == len(set(launched)) == 3  # nothing ran twice
    assert after[: len(before)] == before  # the first run's records are kept as they were
    # The killed run's workers stopped by themselves once the driver was gone.
    time.sleep(2)
    leftover = subprocess.run(
        ["pgrep", "-f", f"autoshard.trials.worker --control {out}"], capture_output=True, text=True
    )
    assert leftover.stdout.strip() == ""


def test_tune_cli_bad_input_is_one_line(cli) -> None:
    gpt = f"{EXAMPLES}/gpt.py:build"
    for args, message in [
        (["--gpu-memory", "lots"], "cannot read 'lots' as a size"),
        (["--gpu-memory", "1GiB", "--batch-size", "0"], "--batch-size 0"),
        (["--gpu-memory", "1GiB", "--engine", "deepspeed"], "choose one of fsdp1, fsdp2"),
        (["--gpu-memory", "1GiB", "--precision", "fp8"], "--precision fp8"),
    ]:
        code, out, err = cli("tune", gpt, "--arg", "size=tiny", *args)
        assert code == 1, (args, out, err)
        assert message in err and "Traceback" not in err


def test_tune_cli_without_gpu_says_which_gpu_it_plans_for(cli, tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: its memory is the default")
    code, _, err = cli("tune", f"{EXAMPLES}/gpt.py:build", "--gpus", "0")
    assert code == 1 and "--gpus 0" in err and "Traceback" not in err


class _MeasuredGroup:
    """The worker group with its measurements given (trial i's step time ``STEPS[i]``): the
    study's loop, calibration, decision and outputs run as in a real study, in process."""

    STEPS = (1.0, 0.25, 0.5)  # the second trial, the first tried with calibrated factors, wins

    def __init__(self, *_: object, **__: object) -> None:
        self.ran = 0

    def __enter__(self) -> _MeasuredGroup:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def run(self, candidate, workload, **_: object) -> TrialResult:
        step = self.STEPS[self.ran % len(self.STEPS)]
        self.ran += 1
        samples = 2 * candidate.micro_batch_size / step
        return TrialResult(
            candidate=candidate, status=TrialStatus.OK, device="cpu", world_size=2,
            step_time=step, step_time_spread=0.01, samples_per_s=samples,
            tokens_per_s=samples * workload.seq_len, peak_allocated=(2**20, 2**20),
        )  # fmt: skip


@pytest.mark.parametrize("door", ["autoshard.tune", "autoshard tune --json"])
def test_a_tuned_decision_times_its_timeline_with_the_calibrated_model(
    tmp_path, examples_gpt_tiny, monkeypatch, cli, door
) -> None:
    """The chosen candidate was predicted by the model calibrated on the trial before it: its
    timeline is timed with those factors, so its step time is the chosen one's predicted step
    time (one answer), through the returned decision, recommendation.json and the report; a
    resumed study's decision is timed as its own prediction."""
    from autoshard import search
    from autoshard.results import Decision

    monkeypatch.setattr(search, "WorkerGroup", _MeasuredGroup)

    def tuned() -> Decision:
        if door == "autoshard.tune":
            return tune(
                examples_gpt_tiny, gpus=2, gpu="cpu-gloo", gpu_memory=4 * GIB,
                precision="32-true", seq_len=32, batch_size=1, trials=3, out_dir=tmp_path,
                progress=False, compile=False,
            )  # fmt: skip
        code, out, err = cli(
            "tune", f"{EXAMPLES}/gpt.py:build", "--arg", "size=tiny", "--gpus", "2", "--gpu",
            "cpu-gloo", "--gpu-memory", "4GiB", "--precision", "32-true", "--seq-len", "32",
            "--batch-size", "1", "--trials", "3", "--out", str(tmp_path), "--json",
            "--no-compile",  # one calibration class: its second trial is calibrated on the first
        )  # fmt: skip
        assert code == 0, err
        return Decision.model_validate_json(out)

    rec = tuned()
    predicted = rec.chosen.estimate.speed
    assert rec.chosen.trial.step_time == 0.25 and predicted.calibrated
    timeline = rec.timeline
    assert timeline is not None and timeline.calibrated
    assert timeline.step_time_s == pytest.approx(predicted.step_time_s, rel=1e-9)
    # the events' span plus what is off the turns is that step time too
    span = max(e.end_s for e in timeline.events) + sum(timeline.untimed.values())
    assert span == pytest.approx(predicted.step_time_s, rel=1e-6)
    saved = Decision.model_validate_json((tmp_path / "recommendation.json").read_text())
    assert saved.timeline == timeline
    report = (tmp_path / "report.html").read_text()
    assert "on the calibrated speed model" in report and "uncalibrated speed model" not in report

    # Resumed: every trial is done, none runs again, and each is judged against the prediction
    # it was tried with, read back from the study: the same decision, step time and timeline.
    again = tuned()
    assert again.chosen.candidate == rec.chosen.candidate
    assert again.chosen.estimate == rec.chosen.estimate and again.timeline == timeline
    # calibrated on trials of 1.0, 0.25, 0.5 s (0.73 s, or 1.0 s where the fit takes another
    # factor on this CPU's measured rates); the uncalibrated prior's is about 0.05 s
    assert predicted.calibrated and predicted.step_time_s > 0.2
    assert [r.estimate for r in again.runners_up] == [r.estimate for r in rec.runners_up]
    resumed = (tmp_path / "report.html").read_text()
    assert "on the calibrated speed model" in resumed and "uncalibrated speed model" not in resumed


def test_a_study_recorded_without_its_predictions_resumes_on_the_plans(
    tmp_path, examples_gpt_tiny, monkeypatch
) -> None:
    """A study whose trials carry no record of what they were tried with (an older autoshard)
    resumes as before: each trial against the plan's uncalibrated prediction, said in one line."""
    from autoshard import search
    from autoshard.errors import StudyNotice

    monkeypatch.setattr(search, "WorkerGroup", _MeasuredGroup)

    def tuned() -> Decision:
        return tune(
            examples_gpt_tiny, gpus=2, gpu="cpu-gloo", gpu_memory=4 * GIB,
            precision="32-true", seq_len=32, batch_size=1, trials=3, out_dir=tmp_path,
            progress=False,
        )  # fmt: skip

    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        rec = tuned()
    assert not [w for w in first if issubclass(w.category, StudyNotice)]
    db = sqlite3.connect(tmp_path / DATABASE_FILE)  # as an older autoshard wrote it
    with db:
        dropped = db.execute(
            "DELETE FROM trial_user_attributes WHERE key = 'autoshard_factors'"
        ).rowcount
    db.close()
    assert dropped == 3
    with pytest.warns(StudyNotice, match="3 trials of study .* recorded without the prediction"):
        again = tuned()
    assert again.chosen.candidate == rec.chosen.candidate
    own = again.chosen.estimate.speed
    assert not own.calibrated and own.step_time_s < 0.2  # the plan's (0.054 s), not 0.728 s
    assert again.timeline is not None and not again.timeline.calibrated
    assert again.timeline.step_time_s == pytest.approx(own.step_time_s, rel=1e-9)
