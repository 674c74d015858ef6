"""The collectives FSDP runs for one unit, in seconds: the bytes each moves per rank over the
link its group runs at.

A ring all-gather or reduce-scatter over a group of ``n`` moves ``(n - 1) / n`` of the unit, an
all-reduce twice that; parameters are gathered in the compute dtype, gradients reduced in the
reduce dtype (:mod:`autoshard.engine`). A group inside one node runs at the GPU's link inside the
node; a ring spanning nodes carries the whole group's traffic across each node's network (every
node's GPUs share its NICs), so it runs at the slower of the GPU's link and
``inter_node_bandwidth x ranks of the group per node / GPUs per node``.
"""

from __future__ import annotations

from autoshard.config import Candidate, Hardware
from autoshard.engine import element_bytes, reduce_bytes, shard_group
from autoshard.gpus import GPUSpec


def ring_bandwidth(gpu: GPUSpec, hardware: Hardware, size: int, per_node: int) -> float:
    """Link bytes/s of a ring over a group of ``size`` ranks, ``per_node`` of them in each node
    it spans. Inside a node: the GPU's link. Across nodes: each node's network carries the
    group's ring traffic once per direction for every concurrent group in the node (``GPUs per
    node / per_node`` of them), so the ring gets ``inter x per_node / gpus_per_node``, unless
    the GPU's own link is slower."""
    per_node = max(1, min(per_node, size, hardware.gpus_per_node))
    if size <= per_node or hardware.nodes == 1:
        return gpu.intra_node_bandwidth
    across = gpu.inter_node_bandwidth * per_node / hardware.gpus_per_node
    return min(gpu.intra_node_bandwidth, across)


class Collectives:
    """Seconds of each collective of one unit of ``params`` parameters, for one candidate."""

    def __init__(
        self,
        candidate: Candidate,
        hardware: Hardware,
        gpu: GPUSpec,
        *,
        latency_s: float,
        efficiency: float,
    ) -> None:
        self.latency = latency_s
        # FSDP gathers into a new tensor and reduce-scatters into a new shard; where memory is
        # mapped afresh (CPU trial workers), their pages fault in as the collective writes them.
        self.fresh_page = gpu.fresh_page_bandwidth
        gpn = hardware.gpus_per_node
        _, cb = element_bytes(candidate.precision)
        self.gather_bytes: float = cb  # float8 gathers its linear weights in 1 byte (recipe.py)
        self.reduce_bytes = reduce_bytes(candidate)
        eff = efficiency
        self.shard, self.replicas = shard_group(candidate, hardware)
        # a shard group spans as many ranks of each node as it can; the replicas of a shard
        # are one per shard group, ``gpus_per_node / shard`` of them in each node
        self.shard_bw = ring_bandwidth(gpu, hardware, self.shard, gpn) * eff
        per_node = max(1, gpn // self.shard)
        self.replica_bw = ring_bandwidth(gpu, hardware, self.replicas, per_node) * eff

    def _ring(self, nbytes: float, size: int, bandwidth: float, factor: float = 1.0) -> float:
        if size <= 1 or nbytes <= 0:
            return 0.0
        return self.latency + factor * (size - 1) / size * nbytes / bandwidth

    def _new_output(self, nbytes: float) -> float:
        return nbytes / self.fresh_page if self.fresh_page and self.shard > 1 else 0.0

    def all_gather(self, params: float) -> float:
        """Gather a unit's parameters in the compute dtype from its shard group."""
        nbytes = params * self.gather_bytes
        return self._ring(nbytes, self.shard, self.shard_bw) + self._new_output(nbytes)

    def reduce(self, params: float) -> float:
        """Reduce a unit's gradients: reduce-scatter in the shard group, then all-reduce of the
        shard across replicas (HYBRID_SHARD), or one all-reduce (NO_SHARD, in place)."""
        nbytes = params * self.reduce_bytes
        scatter = self._ring(nbytes, self.shard, self.shard_bw)
        scatter += self._new_output(nbytes / self.shard)
        across = self._ring(nbytes / self.shard, self.replicas, self.replica_bw, factor=2.0)
        return scatter + across
