"""What the CUDA caching allocator keeps *reserved* beyond the bytes a training step allocates
at its peak: what ``torch.cuda.max_memory_reserved`` reports and what the device must hold.

Two mechanisms, each read from the code that does it (torch 2.13):

- **Pools per stream.** The caching allocator reuses a freed block only for an allocation on the
  same stream (``c10/cuda/CUDACachingAllocator.cpp``: a pool's free blocks are searched by
  stream, then size; with expandable segments each stream grows a segment of its own). FSDP2
  allocates each all-gather output on its all-gather copy-in stream and each reduced gradient
  shard on its reduce-scatter stream (``torch/distributed/fsdp/_fully_shard/
  _fsdp_collectives.py``, ``foreach_all_gather`` and ``foreach_reduce``: "the GPU sharded
  gradient is allocated in the RS stream"). Those pools stay reserved for the whole step, so at
  a compute peak with no gradient alive (the loss, under a loop that zeroes gradients after the
  step) the gradient shards and the largest all-gather output are reserved, not allocated.
- **The loss's hole.** The loss casts the 16-bit logits to fp32 and keeps the fp32
  log-probabilities; the logits and the cast are freed before backward, which then allocates
  the log-probabilities' gradient and its input's gradient, each twice the logits' size. A
  best-fit allocator puts the first into the freed space (three logits' worth) and must grow the
  segment for the second: the pool ends one 16-bit logits' size above the allocated peak.

Not modelled: other fragmentation. Without expandable segments (PyTorch's default) large
blocks are rounded and segments cannot grow in place; torchtitan's PR 165 printed 20-36%
reserved over active for Llama 2 7B on 8 H100 there (``benchmarks/results/published_memory.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.config import Engine, Hardware
from autoshard.predict.step_bytes import StepBytes
from autoshard.predict.step_memory import MemoryEvent

__all__ = ["ReservedPeak", "reserved_peak", "stream_pools"]


@dataclass(frozen=True)
class ReservedPeak:
    """The allocated peak of a step and what the caching allocator reserves beyond it (the plan's
    allowance counts the stream pools; the loss's hole is deduced, not yet measured)."""

    allocated: int  # the largest live bytes over the step's events
    stream_pools: int  # FSDP2's communication streams' pools, beyond what the peak holds there
    loss_hole: int  # the compute pool's growth past the peak around the loss's backward

    @property
    def reserved(self) -> int:
        return self.allocated + self.stream_pools + self.loss_hole


def stream_pools(t: StepBytes, hardware: Hardware, at: MemoryEvent) -> int:
    """FSDP2's all-gather and reduce-scatter streams' pools that the peak event ``at`` does not
    already count as live (its gradients, its communication buffers): what the plan's GPU
    allowance counts of the reserved peak; nothing for CPU processes (gloo)."""
    if hardware.backend == "gloo":
        return 0  # no caching allocator
    if t.candidate.engine is not Engine.FSDP2:
        return 0  # FSDP1's streams are not modelled
    cb = t.compute_dtype_bytes
    # the largest all-gather output: the root unit's, or a block's beside the prefetched next;
    # none where nothing is sharded (FSDP2 then copies on the default stream), while the
    # reduced gradients still come from the reduce-scatter stream
    gathered = (max(t.root_params, 2 * t.block_params) if t.wrapped else t.params) * cb
    gathered_extra = max(0, gathered - at.live.comm_buffers) if t.shard > 1 else 0
    shards_extra = max(0, t.grad_shard_bytes - at.live.gradients)
    return gathered_extra + shards_extra


def _loss_hole(t: StepBytes, events: list[MemoryEvent], at: MemoryEvent, seq_len: int) -> int:
    """How far the compute pool grows past the allocated peak around the loss's backward."""
    cb = t.compute_dtype_bytes
    if cb != 2 or not t.profile.vocab_size or not seq_len:
        return 0  # fp32 logits are not cast: no 16-bit copy is freed before backward
    logits = t.candidate.micro_batch_size * seq_len * t.profile.vocab_size * cb
    loss = next((e for e in events if e.name == "loss"), None)
    if loss is None:
        return 0
    return max(0, loss.live.total + logits - at.live.total)


def reserved_peak(
    t: StepBytes, hardware: Hardware, events: list[MemoryEvent], at: MemoryEvent, seq_len: int
) -> ReservedPeak:
    """The reserved peak of a step of ``t.candidate`` (as the engine runs it) whose events are
    ``events`` and whose allocated peak is ``at``: nothing beyond the peak for CPU processes
    (gloo), which have no caching allocator."""
    allocated = at.live.total
    if hardware.backend == "gloo":
        return ReservedPeak(allocated, 0, 0)
    pools = stream_pools(t, hardware, at)
    return ReservedPeak(allocated, pools, _loss_hole(t, events, at, seq_len))
