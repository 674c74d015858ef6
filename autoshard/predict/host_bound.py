"""The host-bound floor of a step: the seconds the CPU thread of a rank spends issuing the step,
which a GPU step cannot beat however little work each kernel does.

Eager PyTorch issues every kernel from Python (modules, the dispatcher, autograd, the launch),
and FSDP runs Python hooks around every unit (gathers, parameter views, the reduction's set-up)
on the same thread. The GPU runs the queued kernels meanwhile, so a step takes the longer of the
two: its GPU time (the speed model's terms) or its host time. A large model's kernels are long
and the host is far ahead (Llama 3.1 8B at 8k tokens on 8 H100: 0.14 s of host work in a 2.8 s
step); a 35-token step of a 64-block model is all host (Lightning's demo Transformer: 4,200
kernels and 65 FSDP units for 0.2 TFLOP).

Host seconds of one step = per micro-batch, the kernels of its forward, backward and recompute
(counted on fake tensors by the FLOP profile, after torch.compile's fusion) x the host cost of
one kernel (``SpeedFactors.op_overhead_s``), plus the FSDP units x what FSDP's hooks cost a unit
(:data:`FSDP_UNIT_HOST_S`). The surplus over the GPU time is ``SpeedBreakdown.host_bound_s``.

Not counted: CUDA graphs (not assumed), the optimizer's launches (a foreach or fused optimizer
issues a few kernels per group of tensors) and a trainer's own per-step work (progress bar,
logging), for which no measurement was made. On CPU processes (``cpu-gloo``) the host is the
device: the speed model already adds the host's work to each piece, and FSDP's cost per unit is
its ``collective_latency_s``, so the floor is not applied there.
"""

from __future__ import annotations

from autoshard.config import Candidate, Checkpointing, Engine, Hardware
from autoshard.engine import traits
from autoshard.predict.flops import FlopProfile
from autoshard.predict.timeline import MicroBatch, Pass, Turn, Work
from autoshard.predict.work_seconds import per_analysed_block
from autoshard.results import ModelProfile

# Host seconds FSDP adds to one step per unit (hooks, parameter views, the collectives' calls),
# measured on this project's VM (Xeon, one thread, torch 2.13): a 16-block Llama-style decoder
# at width 16 on 2 gloo ranks, each block a unit, minus the same step without FSDP, per unit
# (benchmarks/host_overhead_probe.py; results/host_overhead_probe.txt: the least of three runs
# on the shared machine, where other jobs only add). Keyed by (engine, gathers again in
# backward, shards parameters). The gloo calls' own CPU work (a bare 1 KB all-gather: 0.075 ms,
# results/cpu_gloo_probe.txt) is in it: under NCCL a call is a launch, so this overstates a GPU
# rank's cost by up to 0.2 ms per unit. The same order as FSDP2's 'FSDP::pre_forward calls take
# 50% of the step time ... 1 ms launches' on 'a standard over-provisioned Xeon machine'
# (pytorch/pytorch issue #173680).
FSDP_UNIT_HOST_S = {
    (Engine.FSDP1, True, True): 2.3e-3,  # FULL_SHARD, HYBRID_SHARD
    (Engine.FSDP1, False, True): 1.7e-3,  # SHARD_GRAD_OP
    (Engine.FSDP1, False, False): 1.6e-3,  # NO_SHARD
    (Engine.FSDP2, True, True): 3.0e-3,  # reshard_after_forward=True
    (Engine.FSDP2, False, True): 2.25e-3,  # reshard_after_forward=False
    (Engine.FSDP2, False, False): 2.25e-3,  # replicated: no measurement of its own
}


def unit_host_seconds(candidate: Candidate, hardware: Hardware) -> float:
    """Host seconds FSDP's hooks cost one unit in one micro-batch (forward and backward). None
    on one GPU: a single device needs no FSDP wrapper (Lightning's 'auto' strategy there), the
    fixed cost of running distributed at all."""
    if hardware.world_size <= 1:
        return 0.0
    sharding = traits(candidate)
    regathers = sharding.reshards and sharding.shards_params
    return FSDP_UNIT_HOST_S[(candidate.engine, regathers, sharding.shards_params)]


class _Kernels:
    """Kernels of each piece of one micro-batch's work, per block or outside the blocks."""

    def __init__(self, profile: ModelProfile, flops: FlopProfile, *, selective: bool) -> None:
        rerun = flops.selective_recompute() if selective else None
        recompute = rerun.block_forward_ops if rerun else flops.block_forward_ops
        count = profile.block_count
        # the analysed blocks' kernels by the rule that gives them their seconds
        self.per_block = {
            Pass.FORWARD: per_analysed_block(flops.block_forward_ops, count),
            Pass.BACKWARD: per_analysed_block(flops.block_backward_ops, count),
            Pass.RECOMPUTE: per_analysed_block(recompute, count),
        }
        self.other = {
            Pass.FORWARD: flops.other_forward_ops,
            Pass.BACKWARD: flops.other_backward_ops,
        }

    def of(self, piece: Work) -> float:
        if piece.blocks is None:
            return self.other.get(piece.kind, 0)
        ops, blocks = self.per_block[piece.kind], piece.blocks
        if len(blocks) == 1:  # a block's turn: no sum to start (the same number)
            return ops[blocks[0]] if blocks[0] < len(ops) else 0
        return sum(ops[i] for i in blocks if i < len(ops))


def host_seconds(
    step: list[MicroBatch],
    profile: ModelProfile,
    flops: FlopProfile,
    candidate: Candidate,
    hardware: Hardware,
    *,
    op_s: float,
    unit_scale: float = 1.0,
) -> float:
    """Host seconds of one step: every micro-batch's kernels at ``op_s`` each and its FSDP
    units' hooks (a unit is a turn of the forward: the root, each block), ``unit_scale`` times
    the measured cost."""
    kernels = _Kernels(profile, flops, selective=candidate.checkpointing is Checkpointing.SELECTIVE)
    unit_s = unit_scale * unit_host_seconds(candidate, hardware)

    def turn_seconds(turn: Turn) -> float:
        return op_s * sum(kernels.of(piece) for piece in turn.work)

    seconds = 0.0
    for mb in step:
        units = sum(1 for turn in mb.forward if turn.name != "root work")
        issued = sum(turn_seconds(t) for t in (*mb.forward, *mb.backward))
        seconds += mb.count * (issued + units * unit_s)
    return seconds


def host_bound_seconds(
    step: list[MicroBatch],
    profile: ModelProfile,
    flops: FlopProfile,
    candidate: Candidate,
    hardware: Hardware,
    *,
    op_s: float,
    unit_scale: float = 1.0,
    device_s: float,
    tail_s: float,
    host_is_device: bool,
) -> float:
    """Seconds a step waits on its host beyond ``device_s``, the GPU's seconds of it: what the
    host's issuing (:func:`host_seconds`) and then ``tail_s`` (the GPU's optimizer step) take
    longer than the GPU's work. 0 where the host is the device (CPU processes: their host work
    is in every piece already).

    The optimizer's kernels are issued last, once backward has returned, so a host-bound GPU
    runs them after the host is done; the next step's host work would hide them only without
    a sync between steps, and trainers read the loss every step (Lightning's progress bar:
    ``self.log("train_loss", loss, prog_bar=True)`` in its FSDP guide's module, a ``.item()``
    at every refresh), so the optimizer's GPU seconds follow the host's.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec, analyze_target
    >>> from autoshard.predict.flops import profile_flops
    >>> from autoshard.predict.timeline import step_timeline
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> flops = profile_flops(built.model, profile, WorkloadSpec(seq_len=128))
    >>> two = Hardware(gpus_per_node=2, gpu_memory=80 * 2**30, gpu="a100-80gb-sxm")
    >>> candidate = Candidate(wrap_classes=profile.wrap_policy)
    >>> step = step_timeline(candidate, two, WorkloadSpec(seq_len=128),
    ...                      blocks=profile.block_count, params=float(profile.total_params),
    ...                      block_params=float(profile.block_params))
    >>> waits = host_bound_seconds(step, profile, flops, candidate, two, op_s=14e-6,
    ...                            device_s=0.001, tail_s=0.0, host_is_device=False)
    >>> round(waits * 1e3)  # ms: 5 units' hooks (11.5) and 180 kernels, less the GPU's 1
    13
    """
    if host_is_device:
        return 0.0
    host = host_seconds(step, profile, flops, candidate, hardware, op_s=op_s, unit_scale=unit_scale)
    return max(0.0, host + tail_s - device_s)
