"""The optimizer step's and CPU offload's seconds (autoshard.predict.optimizer_step): the
copies hidden behind the compute by the engine's rules, the host optimizer on the run's
threads."""

from __future__ import annotations

import pytest

from autoshard.config import Candidate, Hardware
from autoshard.predict.optimizer_step import (
    HOST_OPTIMIZER_THREADS,
    ShardStep,
    host_optimizer_threads,
    optimizer_and_offload,
    optimizer_bytes_per_param,
)


def test_offload_copies_hide_behind_the_compute_but_a_no_shard_gradient_copy() -> None:
    from autoshard.gpus import CATALOGUE
    from autoshard.predict.factors import SpeedFactors

    gpu, factors, params = CATALOGUE["h200"], SpeedFactors(), 1e9
    link = gpu.host_link_bandwidth * factors.host_efficiency
    copy = params * 4 / link

    def offload(sharding: str, ranks: int, compute_s: float, engine: str = "fsdp1") -> float:
        candidate = Candidate(
            engine=engine, sharding=sharding, precision="32-true", cpu_offload=True
        )
        hardware = Hardware(gpus_per_node=ranks, gpu_memory=80 * 2**30)
        seconds, optimizer = optimizer_and_offload(
            candidate, hardware, gpu, factors, ShardStep(params, 1, 1, compute_s)
        )
        assert optimizer == 0
        return seconds

    host = params * optimizer_bytes_per_param(Candidate(precision="32-true"))
    host /= min(
        factors.host_memory_bandwidth, HOST_OPTIMIZER_THREADS * factors.host_thread_bandwidth
    )
    # NO_SHARD: the two copies to the device hidden, the blocking copy back exposed
    assert offload("NO_SHARD", 1, compute_s=10.0) == pytest.approx(host + copy)
    # sharded: every copy beside the compute; with no compute to hide behind, all three exposed
    assert offload("FULL_SHARD", 1, compute_s=10.0) == pytest.approx(host)
    assert offload("FULL_SHARD", 1, compute_s=0.0) == pytest.approx(host + 3 * copy)
    # every micro-batch's forward and backward copy the shard (accumulation: 4 x 2 copies)
    candidate = Candidate(sharding="FULL_SHARD", precision="32-true", cpu_offload=True)
    accumulated, _ = optimizer_and_offload(
        candidate, Hardware(gpus_per_node=1, gpu_memory=80 * 2**30), gpu, factors,
        ShardStep(params, shard=1, accumulate=4, compute_s=0.0),
    )  # fmt: skip
    assert accumulated == pytest.approx(host + (4 * 2 + 1) * copy)
    # FSDP2's copies: one after another, nothing hidden (one gather at one shard, one back)
    assert offload("NO_SHARD", 1, compute_s=10.0, engine="fsdp2") == pytest.approx(host + 2 * copy)


def test_host_cores_given_or_this_machines() -> None:
    # the cores per node come from the options, or from this machine when planning for it (its
    # CPU processes here); planning for GPUs elsewhere leaves them unknown
    import os
    import warnings

    from autoshard.detect import detect_hardware

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        here = detect_hardware(gpu="cpu-gloo", gpus=2, trials=True)
        given = detect_hardware(gpus=8, gpu="h100-sxm", host_cores=96)
        elsewhere = detect_hardware(gpus=8, gpu="h100-sxm")
    assert here.host_cores == os.cpu_count()
    assert (given.host_cores, elsewhere.host_cores) == (96, None)
    assert host_optimizer_threads(given) == 12
