"""optuna-dashboard on a real study: one parameter per knob, a named objective that is the
decision's, and the recommended trial named (started on 127.0.0.1, stopped by its PID)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest

import autoshard
from autoshard.study.knobs import KNOBS

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = shutil.which("optuna-dashboard") or str(
    Path(sys.executable).with_name("optuna-dashboard")
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.slow
@pytest.mark.skipif(not Path(DASHBOARD).exists(), reason="optuna-dashboard is not installed")
def test_dashboard_shows_the_knobs_the_objective_and_the_recommended_trial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec = autoshard.tune(
            "examples/gpt.py:build", kwargs={"size": "tiny"}, seq_len=64, batch_size=[1, 2],
            gpu_memory="2GiB", trials=3, warmup=1, steps=2, out_dir=tmp_path, progress=False,
        )  # fmt: skip
    port = _free_port()
    server = subprocess.Popen(
        [DASHBOARD, f"sqlite:///{tmp_path / 'study.db'}", "--host", "127.0.0.1",
         "--port", str(port), "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}/api"
        deadline = time.monotonic() + 60
        while True:
            try:
                studies = _get(f"{base}/studies")
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
                assert time.monotonic() < deadline, "optuna-dashboard did not answer in 60 s"
                time.sleep(0.5)
        (study,) = [s for s in studies["study_summaries"] if s["study_name"] == rec.study]
        detail = _get(f"{base}/studies/{study['study_id']}")
    finally:
        server.terminate()  # by its PID, this test's own process
        server.wait(timeout=30)
    # One parameter per knob, in every trial that ran or was ruled out.
    assert {p["name"] for p in detail["union_search_space"]} == set(KNOBS)
    ran = [t for t in detail["trials"] if t["state"] == "Complete"]
    assert len(ran) >= 2 and all({p["name"] for p in t["params"]} == set(KNOBS) for t in ran)
    # The objective is named, and it is what the decision ranks: CPU trials for planned GPUs
    # record the predicted tokens/s per GPU of the planned GPU.
    assert detail["objective_names"] == ["predicted tokens/s per GPU (h100-sxm)"]
    attrs = {a["key"]: a["value"] for a in detail["user_attrs"]}
    assert "CPU processes" in attrs["objective"]
    # The recommended trial is named, and it is one that ran, holding autoshard's choice.
    recommended = json.loads(attrs["recommended"])
    label = rec.chosen.candidate.label()
    assert recommended["candidate"] == label and recommended["basis"] == "trials"
    (marked,) = [t for t in detail["trials"] if t["number"] == recommended["trial"]]
    marked_attrs = {a["key"]: a["value"] for a in marked["user_attrs"]}
    assert marked["state"] == "Complete" and marked_attrs["candidate"] == label
    assert f"autoshard recommends trial {recommended['trial']}" in detail["note"]["body"]
    # optuna's best trial is the recommendation: the study's objective is the decision's
    (best,) = detail["best_trials"]
    assert best["number"] == recommended["trial"], (best["number"], recommended)
    predicted = rec.chosen.estimate.speed.tokens_per_s_per_gpu
    assert marked["values"][0] == pytest.approx(predicted)
    # candidates never launched are not trials (optuna-dashboard would call them pruned): the
    # study counts them by reason, and the run's report lists them
    assert {t["state"] for t in detail["trials"]} <= {"Complete", "Fail"}
    never = json.loads(attrs["not_launched"])
    outcomes = rec.outcome_counts()
    assert never["skipped"]["count"] == outcomes["skipped"] > 0
    assert sum(never["skipped"]["reasons"].values()) == outcomes["skipped"]
    assert len(ran) == outcomes["measured"]
