"""The optimizer step's seconds, on the GPU or, with CPU offload, on the host beside the copies
of each shard to the GPU and back: what :func:`autoshard.predict.speed.predict_speed` adds
after the last micro-batch (``SpeedBreakdown.optimizer_s``, ``offload_s``)."""

from __future__ import annotations

import math
from typing import NamedTuple

from autoshard.config import OPTIMIZER_TRAITS, Candidate, Hardware
from autoshard.engine import element_bytes, policy_of
from autoshard.gpus import GPUSpec
from autoshard.predict.factors import SpeedFactors


def optimizer_bytes_per_param(candidate: Candidate) -> int:
    """Bytes of memory traffic per parameter of one optimizer step: its passes over tensors of
    the stored dtype (fp32, or bf16 under ``bf16-true``), from its row of
    :data:`~autoshard.config.OPTIMIZER_TRAITS`."""
    row = OPTIMIZER_TRAITS[candidate.optimizer]
    return row.step_bytes_per_param(candidate.optimizer_impl, element_bytes(candidate.precision)[0])


# The host threads of each rank's CPU optimizer step in autoshard's GPU trials: the worker group
# sets OMP_NUM_THREADS=4 for every rank unless the caller set it (autoshard/trials/group.py),
# whatever the ranks per node. What the trials' own predictions are made with
# (``SpeedInputs.host_threads``); a user's run has its own (:func:`host_optimizer_threads`).
HOST_OPTIMIZER_THREADS = 4


def host_optimizer_threads(hardware: Hardware) -> float:
    """Threads of each rank's host optimizer step (CPU offload) in the run planned for: the
    node's ``host_cores`` over its ranks where the cores are known (at least 1: Lightning's
    launchers set ``max(1, cpus // processes)``, lightning.fabric.utilities.distributed.
    _suggested_max_num_threads, unless OMP_NUM_THREADS is set); not known, what torchrun gives:
    1 a rank where a node runs several (torch/distributed/run.py: ``if "OMP_NUM_THREADS" not in
    os.environ and nproc_per_node > 1``: 1), and for one rank a node torch's default, every
    core (no thread bound: the node's memory bandwidth binds, ``math.inf``)."""
    if hardware.host_cores is not None:
        return float(max(1, hardware.host_cores // hardware.gpus_per_node))
    return 1.0 if hardware.gpus_per_node > 1 else math.inf


class ShardStep(NamedTuple):
    """What one step's optimizer and offload move and hide behind: the model's ``params``,
    sharded over ``shard`` ranks, ``accumulate`` micro-batches, ``compute_s`` busy seconds
    of compute and recompute, and the ``threads`` of each rank's host optimizer step."""

    params: float
    shard: int
    accumulate: int
    compute_s: float
    threads: float = HOST_OPTIMIZER_THREADS


def optimizer_and_offload(
    candidate: Candidate, hardware: Hardware, gpu: GPUSpec, factors: SpeedFactors, step: ShardStep
) -> tuple[float, float]:
    """(offload seconds, optimizer seconds) of one ``step``: the optimizer on the GPU, bound by
    its memory bandwidth; or, with CPU offload, the copies of the parameter shard to the GPU and
    of the gradient shard back that the ``compute_s`` does not hide (the engine's rules:
    :meth:`~autoshard.engine.EnginePolicy.offload_transfers`), and each rank's optimizer
    stepping its shard in host memory after the backward, all ranks of a node at once, each on
    the step's ``threads`` (:func:`host_optimizer_threads`)."""
    params, shard, accumulate, compute_s, host_threads = step
    stored, _ = element_bytes(candidate.precision)
    shard_params = params / max(shard, 1)
    step_bytes = shard_params * optimizer_bytes_per_param(candidate)
    if not candidate.cpu_offload:
        return 0.0, step_bytes / (gpu.hbm_bandwidth * factors.memory_efficiency)
    transfers = policy_of(candidate).offload_transfers(candidate, shard, accumulate)
    link = gpu.host_link_bandwidth * factors.host_efficiency
    to_device_s = shard_params * stored * transfers.to_device / link
    to_host_s = shard_params * stored / link  # the gradient, once per step
    if transfers.hidden:
        beside = to_device_s + (0.0 if transfers.blocking_grads else to_host_s)
        offload_s = max(0.0, beside - compute_s) + (to_host_s if transfers.blocking_grads else 0)
    else:
        offload_s = to_device_s + to_host_s
    if gpu.host_is_device:  # the host is the device: each rank's share of its memory
        offload_s += step_bytes / (gpu.hbm_bandwidth * factors.memory_efficiency)
    else:
        # each rank's share of the node's memory bandwidth, at most what its threads stream
        share = factors.host_memory_bandwidth / hardware.gpus_per_node
        threads = host_threads * factors.host_thread_bandwidth
        offload_s += step_bytes / min(share, threads)
    return offload_s, 0.0
