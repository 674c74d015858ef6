"""Two "nodes" on loopback: the worker group spans them with torchrun's static rendezvous."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from autoshard.config import Candidate, Sharding, WorkloadSpec
from autoshard.options import TuneOptions
from autoshard.results import TrialStatus
from autoshard.target.resolve import TargetSpec
from autoshard.trials.group import WorkerGroup, free_port

pytestmark = pytest.mark.slow


def test_two_nodes_on_loopback(tmp_path, examples_gpt_tiny) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    common = dict(nproc=2, rdzv_endpoint=endpoint, trial_timeout=120)
    node1 = WorkerGroup(
        examples_gpt_tiny, TuneOptions(node_rank=1, **common), log_dir=tmp_path / "node1", nnodes=2
    )
    server = threading.Thread(target=node1.serve, daemon=True)
    server.start()
    with WorkerGroup(
        examples_gpt_tiny, TuneOptions(node_rank=0, **common), log_dir=tmp_path / "node0", nnodes=2
    ) as node0:
        hybrid = Candidate(
            wrap_classes=("gpt.Block",), precision="32-true",
            sharding="HYBRID_SHARD", hybrid_mesh=(2, 2),
        )  # fmt: skip
        result = node0.run(hybrid, WorkloadSpec(seq_len=32))
        assert result.status is TrialStatus.OK, result.error
        assert result.world_size == 4 and len(result.peak_allocated) == 4
        full = node0.run(
            hybrid.model_copy(update={"sharding": Sharding.FULL_SHARD, "hybrid_mesh": None}),
            WorkloadSpec(seq_len=32),
        )
        assert full.status is TrialStatus.OK, full.error
    server.join(timeout=60)
    assert not server.is_alive()  # node 1 stopped when node 0 closed the study
    assert node1.launches == 1


NODE0_DRIVER = """
import sys, time
from pathlib import Path
from autoshard.config import Candidate, WorkloadSpec
from autoshard.options import TuneOptions
from autoshard.target.resolve import TargetSpec
from autoshard.trials.group import WorkerGroup

options = TuneOptions(nproc=2, node_rank=0, rdzv_endpoint=sys.argv[3], warmup=1, steps=1)
group = WorkerGroup(TargetSpec(spec=sys.argv[1], kwargs={"size": "tiny"}), options,
                    log_dir=Path(sys.argv[2]), nnodes=2, start_timeout=90)
result = group.run(Candidate(wrap_classes=("gpt.Block",), precision="32-true"),
                   WorkloadSpec(seq_len=32))
print(result.status.value, flush=True)
time.sleep(3600)  # idle
"""


def test_a_node_stops_serving_when_node_0s_driver_is_killed(tmp_path) -> None:
    from autoshard.errors import AutoshardError

    from .conftest import EXAMPLES, ROOT

    endpoint = f"127.0.0.1:{free_port()}"
    # node 1 learns node 0 is gone when no group forms within its start_timeout: short here;
    # node 0's own start may take longer on a loaded machine (its driver: 90 s)
    node1 = WorkerGroup(TargetSpec(spec=f"{EXAMPLES}/gpt.py:build", kwargs={"size": "tiny"}), TuneOptions(nproc=2, node_rank=1, rdzv_endpoint=endpoint), log_dir=tmp_path / "node1", nnodes=2, start_timeout=30)  # fmt: skip
    ended: list[BaseException | None] = []

    def serve() -> None:
        try:
            node1.serve()
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    driver = subprocess.Popen(
        [sys.executable, "-c", NODE0_DRIVER, f"{EXAMPLES}/gpt.py:build", str(tmp_path / "node0"),
         endpoint],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "ok"
        driver.kill()  # kill -9 of node 0's driver while the group is idle
        driver.wait()
        server.join(timeout=120)
        assert not server.is_alive(), "node 1 went on serving a study whose driver is dead"
        assert isinstance(ended[0], AutoshardError) and "node 0" in str(ended[0])
        assert not node1.alive()
    finally:
        driver.kill()
        node1.kill()
