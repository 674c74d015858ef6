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
(:data:`FSDP_UNIT_HOST_S`), on one GPU too (autoshard's trials and the configurations it hands
over wrap the model in FSDP there as well), plus what the eager recipes run in Python around
the kernels (:func:`recipe_host_seconds`): activation checkpointing's per block, selective
checkpointing's policy on every operation, torchao's float8 layers and their all-gather hooks.
The surplus over the GPU time is ``SpeedBreakdown.host_bound_s``.

Why it binds: a 1B decoder on one H200 at 2,048 tokens measured 108-206 ms a step against 51-60
ms of GPU work predicted (benchmarks/data/measured_gpu.json), and the same trial steps run on
this project's CPU at width 16, where the arithmetic is nothing and only the host's work is
left, took 92-247 ms (benchmarks/results/host_overhead_probe.txt): the host is the step.

Not counted: CUDA graphs (not assumed), the optimizer's launches (a foreach or fused optimizer
issues a few kernels per group of tensors) and a trainer's own per-step work (progress bar,
logging), for which no measurement was made. On CPU processes (``cpu-gloo``) the host is the
device: the speed model already adds the host's work to each piece, and FSDP's cost per unit is
its ``collective_latency_s``, so the floor is not applied there.
"""

from __future__ import annotations

from typing import NamedTuple

from autoshard.config import Candidate, Checkpointing, Engine, Hardware
from autoshard.engine import as_run, traits
from autoshard.predict.flops import FlopProfile
from autoshard.predict.timeline import MicroBatch, Pass, Turn, Work
from autoshard.predict.work_seconds import op_host_seconds, per_analysed_block
from autoshard.results import ModelProfile

# Host seconds FSDP adds to one step per unit (hooks, parameter views, the collectives' calls),
# keyed by (engine, gathers again in backward, shards parameters). Measured:
# benchmarks/results/measured_constants.md, "FSDP's host cost per unit".
FSDP_UNIT_HOST_S = {
    (Engine.FSDP1, True, True): 2.3e-3,  # FULL_SHARD, HYBRID_SHARD
    (Engine.FSDP1, False, True): 1.7e-3,  # SHARD_GRAD_OP
    (Engine.FSDP1, False, False): 1.6e-3,  # NO_SHARD
    (Engine.FSDP2, True, True): 3.0e-3,  # reshard_after_forward=True
    (Engine.FSDP2, False, True): 2.25e-3,  # reshard_after_forward=False
    (Engine.FSDP2, False, False): 2.25e-3,  # replicated: no measurement of its own
}
# On one rank FSDP1's unit (NO_SHARD there, whatever the strategy) costs about what FSDP2's
# resharding unit does (benchmarks/results/measured_constants.md, "Host costs of a step on one
# rank"); the two-rank table's NO_SHARD entry is a replicated unit reducing over gloo, not this.
ONE_RANK_FSDP1_AS = (Engine.FSDP2, True, True)


# What the host costs below were measured with: a host ``op_overhead_s`` times slower per
# kernel runs the recipes' Python that much slower too.
MEASURED_OP_S = 14e-6

# Host seconds of eager recipes beyond the kernels they issue, measured like the units
# (benchmarks/host_overhead_probe.py checkpoint-float8 and units-one-rank; benchmarks/results/
# measured_constants.md, "Host costs of a step on one rank"):
# - a checkpointed block (non-reentrant torch.utils.checkpoint, as apply_checkpointing wraps
#   it), beyond its recomputed kernels, per kernel of the block's forward: the saved-tensor
#   hooks, the RNG and autocast state kept and restored, the recompute's bookkeeping;
# - under op-level selective checkpointing, its policy runs in Python on every operation of
#   the forward and of the recompute (a TorchDispatchMode, create_selective_checkpoint_contexts);
# Under torch.compile the wrapper still runs eagerly around the compiled block (autoshard
# compiles the block inside its checkpoint wrapper, apply_fsdp2), over the compiled block's
# fewer kernels (the run profile's count).
CHECKPOINT_HOST_S_PER_KERNEL = {
    Checkpointing.ALL: 47e-6,
    Checkpointing.EVERY_K: 47e-6,
    Checkpointing.SELECTIVE: 182e-6,
}
# torchao's Float8Linear in eager mode: its amax, scale and cast of the input and the weight in
# forward and of the output gradient in backward run as tensor-subclass dispatch in Python, per
# converted layer per forward and backward (compiled blocks fuse them: none left); its forward
# alone is about a third of that, what a recomputed block runs again.
FLOAT8_LAYER_HOST_S = 1.5e-3
FLOAT8_FORWARD_SHARE = 1 / 3
# FSDP2's float8 all-gather: the pre- and post-all-gather hooks of every converted weight (cast
# the shard, wrap the gathered bytes), per weight and all-gather, eager even in compiled runs.
FLOAT8_GATHER_HOST_S = 0.4e-3
# What a compiled step costs its host beyond its kernels, FSDP's hooks and the recipes above:
# no measurement separates its parts (dynamo's guards, AOTAutograd's runtime wrappers and
# Inductor's launchers on every call run on a GPU only). Fitted with GPU_HOST_SCALE and
# HOST_DEVICE_NORM on the fitting set of autoshard's H200 measurements (benchmarks/
# step_time_gpu.py; results/measured_constants.md); the held-out compiled rows check it.
COMPILED_STEP_HOST_S = 9e-3
# How the host's issuing and the GPU's work of a step overlap: the GPU runs each kernel once it
# is issued and the one before it is done, so the two overlap fully (the step the longer of
# the two) only when a queue of issued kernels is always waiting; a step is a stream of long
# matrix products (the GPU behind) and short element-wise kernels, FSDP's hooks and
# checkpointing's Python (the host behind), so where the two totals are close each waits on
# the other in turn and the step is longer than either. Between the longer (perfect overlap)
# and the sum (none): their p-norm, (host^p + gpu^p)^(1/p), the longer of the two where one is
# far ahead (a 3x longer GPU: +1%), 2^(1/p) of either where they are equal. p fitted with
# GPU_HOST_SCALE and COMPILED_STEP_HOST_S on the fitting set of autoshard's H200 measurements
# (measured_constants.md, "Host costs of a step on one rank").
HOST_DEVICE_NORM = 3.0


def unit_host_seconds(candidate: Candidate, hardware: Hardware) -> float:
    """Host seconds FSDP's hooks cost one unit in one micro-batch (forward and backward), as
    the engine runs ``candidate`` on ``hardware``. On one GPU too: the step still runs every
    unit's hooks (and FSDP2 its one-rank all-gathers); there FSDP1, which runs NO_SHARD,
    costs what FSDP2 does (:data:`ONE_RANK_FSDP1_AS`)."""
    if hardware.world_size == 1 and candidate.engine is Engine.FSDP1:
        return FSDP_UNIT_HOST_S[ONE_RANK_FSDP1_AS]
    candidate = as_run(candidate, hardware)
    sharding = traits(candidate)
    regathers = sharding.reshards and sharding.shards_params
    return FSDP_UNIT_HOST_S[(candidate.engine, regathers, sharding.shards_params)]


def recipe_host_seconds(
    step: list[MicroBatch], forward_kernels: tuple[float, ...], candidate: Candidate,
    float8_layers: float,
) -> float:  # fmt: skip
    """Host seconds of one step's eager recipes beyond their kernels: every checkpointed
    block's per kernel of its forward (``forward_kernels``, per block, as run: fewer under
    torch.compile), and under float8 its ``float8_layers`` converted layers per block, each
    forward and backward in eager mode (a recomputed block's forward again) and each
    all-gather of their weights."""
    per_kernel = CHECKPOINT_HOST_S_PER_KERNEL.get(candidate.checkpointing, 0.0)
    layer_s = 0.0 if candidate.compile else FLOAT8_LAYER_HOST_S
    gathers = (
        1 + (1 if traits(candidate).reshards else 0) if candidate.engine is Engine.FSDP2 else 0
    )
    blocks = len(forward_kernels)
    seconds = 0.0
    for mb in step:
        recomputed = [
            i
            for turn in mb.backward
            for piece in turn.work
            if piece.kind is Pass.RECOMPUTE and piece.blocks is not None
            for i in piece.blocks
        ]
        rerun = sum(forward_kernels[i] for i in recomputed if i < blocks)
        seconds += mb.count * per_kernel * rerun
        if candidate.float8:
            runs = blocks + FLOAT8_FORWARD_SHARE * len(recomputed)
            hooks = gathers * blocks * FLOAT8_GATHER_HOST_S
            seconds += mb.count * (float8_layers * (runs * layer_s + hooks))
    return seconds


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


class HostStep(NamedTuple):
    """What a rank's host issues in one step: the ``step``'s micro-batches of the model
    (``profile``) with the kernels ``flops`` counts, ``candidate`` on ``hardware``."""

    step: list[MicroBatch]
    profile: ModelProfile
    flops: FlopProfile
    candidate: Candidate
    hardware: Hardware


def host_seconds(
    issued: HostStep, *, op_s: float, unit_scale: float = 1.0, float8_layers: float = 0.0
) -> float:
    """Host seconds of the ``issued`` step: every micro-batch's kernels at ``op_s`` each
    (:func:`op_host_seconds`), its FSDP units' hooks (a unit is a turn of the forward: the
    root, each block) ``unit_scale`` times their measured cost, and the eager recipes' Python
    (:func:`recipe_host_seconds`, ``float8_layers`` converted layers per block) as much slower
    than measured as ``op_s`` is than :data:`MEASURED_OP_S`."""
    step, profile, flops, candidate, hardware = issued
    kernels = _Kernels(profile, flops, selective=candidate.checkpointing is Checkpointing.SELECTIVE)
    unit_s = unit_scale * unit_host_seconds(candidate, hardware)
    kernel_s = op_host_seconds(candidate, op_s)

    def turn_seconds(turn: Turn) -> float:
        return kernel_s * sum(kernels.of(piece) for piece in turn.work)

    seconds = 0.0
    for mb in step:
        units = sum(1 for turn in mb.forward if turn.name != "root work")
        kernels_s = sum(turn_seconds(t) for t in (*mb.forward, *mb.backward))
        seconds += mb.count * (kernels_s + units * unit_s)
    forward = kernels.per_block[Pass.FORWARD]
    recipes = recipe_host_seconds(step, forward, candidate, float8_layers)
    recipes += COMPILED_STEP_HOST_S if candidate.compile else 0.0
    return seconds + op_s / MEASURED_OP_S * recipes


def host_bound_seconds(
    issued: HostStep,
    *,
    op_s: float,
    unit_scale: float = 1.0,
    device_s: float,
    tail_s: float,
    host_is_device: bool,
    float8_layers: float = 0.0,
) -> float:
    """Seconds the ``issued`` step waits on its host beyond ``device_s``, the GPU's seconds of
    it: what the host's issuing (:func:`host_seconds`) beside the GPU's work before ``tail_s``
    (:func:`overlapped`), then ``tail_s`` (the GPU's optimizer step), take longer than the GPU's
    work. 0 where the host is the device (CPU processes: their
    host work is in every piece already).

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
    >>> waits = host_bound_seconds(HostStep(step, profile, flops, candidate, two), op_s=14e-6,
    ...                            device_s=0.001, tail_s=0.0, host_is_device=False)
    >>> round(waits * 1e3)  # ms: 5 units' hooks (11.5) and 180 kernels, less the GPU's 1
    13
    """
    if host_is_device:
        return 0.0
    host = host_seconds(issued, op_s=op_s, unit_scale=unit_scale, float8_layers=float8_layers)
    return max(0.0, overlapped(host, device_s - tail_s) + tail_s - device_s)


def overlapped(host_s: float, gpu_s: float) -> float:
    """Seconds of ``host_s`` of issuing and ``gpu_s`` of GPU work that run beside each other:
    their :data:`HOST_DEVICE_NORM`-norm, between the longer and the sum.

    >>> overlapped(1.0, 0.0), round(overlapped(1.0, 1.0), 3), round(overlapped(0.2, 1.0), 4)
    (1.0, 1.26, 1.0027)
    """
    gpu_s = max(0.0, gpu_s)
    if not host_s or not gpu_s:
        return max(host_s, gpu_s)
    p = HOST_DEVICE_NORM
    return float((host_s**p + gpu_s**p) ** (1 / p))
