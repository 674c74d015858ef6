"""The seconds of FSDP's collectives (predict/collectives.py): a ring's time by hand, the ring's
bandwidth inside a node and across nodes, and HYBRID_SHARD's all-reduce across replicas."""

from __future__ import annotations

import pytest

from autoshard.config import Candidate, Hardware
from autoshard.gpus import CATALOGUE
from autoshard.predict.collectives import Collectives, ring_bandwidth

H100 = CATALOGUE["h100-sxm"]
GIB = 2**30


def hardware(nodes: int) -> Hardware:
    return Hardware(nodes=nodes, gpus_per_node=8, gpu_memory=80 * GIB, gpu="h100-sxm")


def test_a_ring_inside_a_node_runs_at_the_gpu_link_and_across_nodes_at_the_networks_share() -> None:
    assert ring_bandwidth(H100, hardware(1), 8, 8) == H100.intra_node_bandwidth
    assert ring_bandwidth(H100, hardware(2), 8, 8) == H100.intra_node_bandwidth  # one node
    # 16 ranks over 2 nodes: the node's network carries the ring once
    across = ring_bandwidth(H100, hardware(2), 16, 8)
    assert across == min(H100.intra_node_bandwidth, H100.inter_node_bandwidth)
    # 2 ranks per node in 4 concurrent rings: each ring gets a quarter of the network
    assert ring_bandwidth(H100, hardware(2), 4, 2) == pytest.approx(
        min(H100.intra_node_bandwidth, H100.inter_node_bandwidth * 2 / 8)
    )


def test_full_shard_gathers_and_reduce_scatters_in_one_ring_by_hand() -> None:
    c = Candidate(precision="bf16-mixed")
    hw = hardware(1)
    coll = Collectives(c, hw, H100, latency_s=1e-5, efficiency=0.5)
    params = 1e9
    bw = H100.intra_node_bandwidth * 0.5
    ring = 1e-5 + 7 / 8 * params * 2 / bw  # bf16: 2 bytes a parameter, 7/8 of it moves
    fresh = params * 2 / H100.fresh_page_bandwidth if H100.fresh_page_bandwidth else 0.0
    assert coll.all_gather(params) == pytest.approx(ring + fresh)
    assert coll.replicas == 1  # nothing to all-reduce across replicas
    assert coll.reduce(0) == 0.0 and coll.all_gather(0) == 0.0


def test_hybrid_shard_adds_an_all_reduce_of_the_shard_across_nodes() -> None:
    hw = hardware(2)
    full = Collectives(Candidate(sharding="FULL_SHARD"), hw, H100, latency_s=0.0, efficiency=1.0)
    hybrid = Collectives(
        Candidate(sharding="HYBRID_SHARD", hybrid_mesh=(2, 8)),
        hw,
        H100,
        latency_s=0.0,
        efficiency=1.0,
    )
    assert (full.shard, full.replicas) == (16, 1)
    assert (hybrid.shard, hybrid.replicas) == (8, 2)
    params = 1e9
    shard_bytes = params * hybrid.reduce_bytes / 8
    across = 2 * (2 - 1) / 2 * shard_bytes / hybrid.replica_bw  # an all-reduce: twice a ring
    inside = 7 / 8 * params * hybrid.reduce_bytes / hybrid.shard_bw
    fresh = hybrid._new_output(params * hybrid.reduce_bytes / 8)
    assert hybrid.reduce(params) == pytest.approx(inside + fresh + across)
