"""Two "nodes" on loopback: the worker group spans them with torchrun's static rendezvous."""

from __future__ import annotations

import threading

import pytest

from autoshard.config import Candidate, Sharding, WorkloadSpec
from autoshard.results import TrialStatus
from autoshard.trials.group import WorkerGroup, free_port

pytestmark = pytest.mark.slow


def test_two_nodes_on_loopback(tmp_path, examples_gpt_tiny) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    common = dict(nproc=2, nnodes=2, rdzv_endpoint=endpoint, trial_timeout=120)
    node1 = WorkerGroup(examples_gpt_tiny, log_dir=tmp_path / "node1", node_rank=1, **common)
    server = threading.Thread(target=node1.serve, daemon=True)
    server.start()
    with WorkerGroup(examples_gpt_tiny, log_dir=tmp_path / "node0", node_rank=0, **common) as node0:
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
