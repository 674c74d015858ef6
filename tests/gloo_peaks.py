"""Memory peaks measured in real FSDP runs on 2 gloo processes, for tests that check the
estimators against them: the test file is also the worker script, launched under
``torch.distributed.run`` (:func:`launch`), whose ``main`` trains each configuration for two
steps under torch's memory tracker (:func:`measure_peaks`, what
``benchmarks/estimate_accuracy.py`` runs over its whole grid)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from autoshard.child_env import child_env

ROOT = Path(__file__).resolve().parents[1]


def candidates(target: dict[str, Any], points: list[dict[str, Any]]) -> list:
    """``points``' candidates of ``target``, wrapping and checkpointing its blocks."""
    from autoshard.analyze import analyze_target
    from autoshard.config import Candidate
    from autoshard.target.resolve import TargetSpec

    profile, _ = analyze_target(TargetSpec(**target))
    return [
        Candidate(
            wrap_classes=profile.wrap_policy, checkpoint_classes=profile.checkpoint_policy, **point
        )
        for point in points
    ]


def measure_peaks(target: dict[str, Any], points: list[dict[str, Any]], seq: int) -> None:
    """The worker: each candidate's training peak (the larger of the two ranks'), written as a
    JSON list to the path in ``sys.argv[1]`` by rank 0."""
    import torch
    import torch.distributed as dist

    from autoshard.config import WorkloadSpec
    from autoshard.predict.simulate import measure_training_peak
    from autoshard.target.resolve import TargetSpec
    from autoshard.trials.worker import exit_worker

    dist.init_process_group("gloo")
    peaks = []
    for candidate in candidates(target, points):
        peak = measure_training_peak(
            TargetSpec(**target), candidate, WorkloadSpec(seq_len=seq), torch.device("cpu")
        )["Total"]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, peak)
        peaks.append(max(gathered))
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(peaks))
    exit_worker()  # not a plain exit: gloo can abort the interpreter's finalization


def launch(script: str, tmp_path: Path) -> list[int]:
    """Run ``script`` (a test file whose ``main`` calls :func:`measure_peaks`) on 2 gloo
    processes, one thread each; the measured peaks."""
    result = tmp_path / "peaks.json"
    env = child_env(ROOT / "examples", ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         "--standalone", script, str(result)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(result.read_text())
