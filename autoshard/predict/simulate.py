"""Simulated per-rank memory: the real FSDP code on fake tensors, with a fake process group.

The analytic estimate (:mod:`autoshard.memory`) is arithmetic; this one runs what a trial runs
(the same :mod:`autoshard.sharding` calls, the same optimizer, the same loss) for two training
steps, with every tensor a ``FakeTensor`` (shapes, no data) and every collective answered by
torch's ``"fake"`` process group, so any world size can be simulated on one CPU with no GPU.
torch's own memory trackers count the bytes (``FSDPMemTracker`` for FSDP2, ``MemTracker`` for
FSDP1), the same trackers :func:`track_training_peak` runs on real tensors in real gloo processes
(``benchmarks/estimate_accuracy.py`` compares the three).

Deep models are not simulated whole: a few blocks of each stack, extrapolated
(:mod:`autoshard.predict.depth`). The trackers' set-up is :mod:`autoshard.predict.tracking`; the
fake process group and what it needs to behave as a real one, :mod:`autoshard.predict.fake_world`.

What no CPU simulation sees (CUDA context, NCCL buffers, the caching allocator's slack) is added
as the same stated allowance as the analytic estimate. CPU offload cannot be simulated here:
with every fake tensor on the CPU, offloaded and resident bytes are indistinguishable (fake CUDA
tensors cannot run backward on a CPU-only build), so offload candidates are refused.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autoshard.config import OPTIMIZER_TRAITS, Candidate, Engine, Hardware, Precision, WorkloadSpec
from autoshard.errors import ConfigError
from autoshard.predict.analytic import allowance, as_run, stream_pools_of
from autoshard.predict.depth import (
    DEEPEN_AT_MOST,
    EXTRAPOLATE_ABOVE,
    EXTRAPOLATE_FROM,
    Phases,
    block_lists,
    deep_lists,
    extrapolate_depth,
    truncate_blocks,
)
from autoshard.predict.fake_world import (
    fake_world,
    fsdp1_allocation_check_on_fakes,
    no_op_moves_skipped,
)
from autoshard.predict.fakes import experts_for_fake_tensors, fake_forward_support
from autoshard.predict.tracking import (
    LOOP_PHASE,
    STEP_PHASE,
    measure_training_peak,
    track_training_peak,
    track_training_phases,
    warnings_off,
)
from autoshard.results import MemoryBreakdown, MemoryEstimate
from autoshard.sharding import apply_fsdp1, apply_fsdp2, make_optimizer, mesh_for
from autoshard.target.resolve import TargetSpec, build_target, load_callable
from autoshard.target.step import find_loss_fn, make_batch, with_labels
from autoshard.target.values_skipped import values_skipped

__all__ = [  # the simulation's names, wherever they are written
    "DEEPEN_AT_MOST",
    "EXTRAPOLATE_ABOVE",
    "EXTRAPOLATE_FROM",
    "LOOP_PHASE",
    "STEP_PHASE",
    "block_lists",
    "measure_training_peak",
    "ranks_to_simulate",
    "refine_with_simulation",
    "simulate_memory",
    "track_training_peak",
    "track_training_phases",
    "truncate_blocks",
]

# Tracker categories -> breakdown fields. FSDP2's tracker knows FSDP's own kinds; FSDP1's
# generic tracker does not: it books every flat parameter storage a module holds as
# "Parameter", the gathered copies with the shards (split by :func:`_split_fsdp1_params`), and
# unsharded gradients show up as temporaries.
_KINDS = {
    "Sharded Param": "sharded_params",
    "Unsharded Param": "unsharded_params",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "All Gather": "comm_buffers",
    "Reduce Scatter": "comm_buffers",
    "OptState": "optimizer",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "Buffer": "buffers",
    "Parameter": "sharded_params",
    "Gradient": "gradients",
    "Optstate": "optimizer",
    "Other": "temporaries",
}


def _simulate_once(
    target: TargetSpec,
    depths: dict[str, int],
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    loss_fn: Any,
    rank: int = 0,
) -> Phases:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu = torch.device("cpu")
    world_size = hardware.world_size
    with fake_world(world_size, hardware.backend, rank), fsdp1_allocation_check_on_fakes():
        mesh = mesh_for(candidate, cpu, world_size)  # outside the fake mode: real rank tensors
        # Built inside the fake mode, not copied from meta: ``to_empty`` cannot swap tied
        # parameters into fake tensors, and FSDP1 needs a model that is not on meta.
        with fake_forward_support(), FakeTensorMode(allow_non_fake_inputs=True), warnings_off():
            with no_op_moves_skipped(), values_skipped():  # fake tensors: no values to write
                built = build_target(target, device=cpu)
            model = built.model
            experts_for_fake_tensors(model)  # the profile's note says so
            truncate_blocks(model, depths)
            if candidate.precision is Precision.BF16_TRUE:
                model = model.to(torch.bfloat16)
            if candidate.engine is Engine.FSDP1:
                # use_orig_params=True, as trials and Lightning run it: the original parameters'
                # gradients are views of the flat gradient, which zero_grad() then leaves
                # allocated until the next backward (use_orig_params=False frees it at once:
                # 6% low under Lightning's order, measured)
                model = apply_fsdp1(model, candidate, cpu, mesh=mesh)
            else:
                model = apply_fsdp2(model, candidate, mesh)
            optimizer = make_optimizer(model.parameters(), candidate)
            batch = make_batch(
                model,
                built.batch,
                micro_batch_size=candidate.micro_batch_size,
                seq_len=workload.seq_len,
                device=cpu,
                data=built.data,
            )
            batch = with_labels(model, batch)
            return track_training_phases(
                model, optimizer, batch, candidate, loss_fn=loss_fn, workload=workload
            )


def simulate_memory(
    target: TargetSpec,
    candidate: Candidate,
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    block_classes: tuple[str, ...] = (),
    pools: int = 0,
    compile_saving: int = 0,
) -> MemoryEstimate:
    """Predict the per-rank GPU peak of ``candidate`` by running it on fake tensors; ``pools``:
    what FSDP2's communication streams keep reserved beside it
    (:func:`autoshard.predict.analytic.stream_pools_of`), added to the allowance.

    A compiled candidate runs here as eager code (inductor's kernels cannot run on fake
    tensors): ``compile_saving``, what compile no longer saves for backward
    (:func:`autoshard.predict.analytic.compile_saving`), is taken off the activations of its
    forward-and-backward phase.

    ``block_classes`` (the analyzer's ``profile.block_classes``) enables depth extrapolation for
    models deeper than :data:`EXTRAPOLATE_ABOVE` blocks (none: the whole depth is simulated).
    Seconds per candidate for small models, tens of seconds for a 70B one.

    >>> from autoshard import Candidate, Hardware, TargetSpec, WorkloadSpec, simulate_memory
    >>> est = simulate_memory(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}),
    ...     Candidate(engine="fsdp2", wrap_classes=("gpt.Block",)),
    ...     Hardware(gpus_per_node=8, gpu_memory=80 * 2**30),
    ...     WorkloadSpec(seq_len=128),
    ... )
    >>> est.method, est.fits, est.gpu_peak == est.breakdown.total
    ('simulated', True, True)
    """
    if candidate.cpu_offload:
        raise ConfigError(
            "CPU offload cannot be simulated on the CPU (offloaded and resident bytes are on the "
            "same device); use the analytic estimate for offload candidates"
        )
    if not OPTIMIZER_TRAITS[candidate.optimizer].fake_steps:
        raise ConfigError(
            f"{candidate.optimizer.value}'s step cannot be simulated (it reads tensor values, "
            "which fake tensors do not have); use the analytic estimate"
        )
    built = build_target(target, device="meta")
    module = sys.modules.get(load_callable(target.spec).__module__)
    loss_fn = find_loss_fn(module)
    deep = deep_lists(block_lists(built.model, block_classes))
    ranks = ranks_to_simulate(built.model, candidate, hardware)

    def run(depths: dict[str, int]) -> Phases:
        by_rank = [
            _simulate_once(target, depths, candidate, hardware, workload, loss_fn, rank)
            for rank in ranks
        ]
        # each phase's peak on the rank that holds the most in it
        return {
            phase: max((p[phase] for p in by_rank if phase in p), key=lambda k: k.get("Total", 0))
            for phase in by_rank[0]
        }

    phases, how = extrapolate_depth(run, deep) if deep else (run({}), "simulated")
    if compile_saving and LOOP_PHASE in phases:
        phases = {**phases, LOOP_PHASE: _less_activations(phases[LOOP_PHASE], compile_saving)}
        how += ", eager, less what torch.compile does not save"
    kinds = max(phases.values(), key=lambda kinds: kinds.get("Total", 0))
    return _estimate(candidate, hardware, kinds, how, pools)


def _less_activations(kinds: dict[str, int], saving: int) -> dict[str, int]:
    """A phase's kinds with ``saving`` bytes fewer activations (never below none)."""
    taken = min(saving, kinds.get("Activation", 0))
    return {**kinds, "Activation": kinds.get("Activation", 0) - taken,
            "Total": kinds.get("Total", 0) - taken}  # fmt: skip


def ranks_to_simulate(model: nn.Module, candidate: Candidate, hardware: Hardware) -> list[int]:
    """The ranks whose peaks the simulation takes the largest of.

    Every rank holds the same bytes, except with frozen parameters under FSDP1: a flat parameter
    is cut into equal contiguous shards, and the optimizer keeps state only for the trainable
    parameters in a rank's shard, so a rank whose shard holds a frozen embedding keeps less
    than one holding the head (measured: 3.1 against 5.1 MiB of AdamW state on the tiny GPT
    with a frozen embedding). The first and the last rank are simulated (exact at 2 ranks; at
    more, ranks in between may hold more)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    if not frozen or as_run(candidate, hardware).engine is not Engine.FSDP1:
        return [0]
    return sorted({0, hardware.world_size - 1})


def _estimate(
    candidate: Candidate, hardware: Hardware, kinds: dict[str, int], how: str, pools: int = 0
) -> MemoryEstimate:
    fields: dict[str, int] = {}
    for kind, nbytes in kinds.items():
        if kind != "Total" and nbytes:
            name = _KINDS.get(kind, "temporaries")
            fields[name] = fields.get(name, 0) + nbytes
    breakdown = MemoryBreakdown(**fields)
    # The tracker's total is the true peak; kinds are the split at that moment. Rounding of the
    # extrapolation can leave them a few bytes apart: the total wins, the difference is temporary.
    peak = kinds.get("Total", breakdown.total)
    breakdown = breakdown.model_copy(
        update={"temporaries": breakdown.temporaries + peak - breakdown.total}
    )
    breakdown = breakdown.model_copy(update={"allowance": allowance(peak, hardware, pools)})
    gpu_peak = breakdown.total
    usable = hardware.usable_gpu_memory
    fits = gpu_peak <= usable
    return MemoryEstimate(
        candidate=candidate,
        method="simulated",
        gpu_peak=gpu_peak,
        host_peak=0,
        breakdown=breakdown,
        fits=fits,
        headroom=usable - gpu_peak,
        reason="" if fits else (
            f"needs {gpu_peak / 2**30:.1f} GiB per GPU, {usable / 2**30:.1f} GiB usable ({how})"
        ),
    )  # fmt: skip


def simulates(candidate: Candidate) -> bool:
    """Whether :func:`simulate_memory` can run ``candidate``: not offloaded, and its optimizer's
    step runs on fake tensors."""
    return not candidate.cpu_offload and OPTIMIZER_TRAITS[candidate.optimizer].fake_steps


def simulated_count(count: int, estimates: Sequence[MemoryEstimate]) -> int:
    """``count``, when there are that many candidates to simulate (those that fit, offload
    excepted: :func:`refine_with_simulation`); else one ConfigError line saying how many there
    are (each simulation takes seconds: asking for more is a typo, not a wish). None fitting
    simulates nothing, as before."""
    simulable = sum(1 for e in estimates if e.fits and simulates(e.candidate))
    if count > simulable > 0:  # none fits: the estimate says so, and nothing is simulated
        raise ConfigError(
            f"--simulate {count}: only {simulable} fitting candidates can be simulated (offload "
            f"and optimizers whose step reads values excepted); give {simulable} or fewer "
            "(simulate= in code)"
        )
    return count


def refine_with_simulation(
    target: TargetSpec,
    ranked: Sequence[MemoryEstimate],
    hardware: Hardware,
    workload: WorkloadSpec,
    *,
    block_classes: tuple[str, ...] = (),
    count: int = 3,
    compile_saving: Callable[[Candidate], int] | None = None,
) -> list[MemoryEstimate]:
    """Replace the analytic estimates of the ``count`` best fitting candidates of ``ranked``
    that it :func:`simulates` with simulated ones; the order is kept, so a candidate the
    simulation finds not to fit stays where it was, marked as such. ``compile_saving``: what a
    compiled candidate's activations lose to compile (:func:`simulate_memory`)."""
    out = list(ranked)
    chosen = [i for i, e in enumerate(out) if e.fits and simulates(e.candidate)][:count]
    for i in chosen:
        pools = stream_pools_of(out[i], hardware)  # as the analytic estimate planned them
        saving = compile_saving(out[i].candidate) if compile_saving else 0
        simulated = simulate_memory(
            target, out[i].candidate, hardware, workload, block_classes=block_classes,
            pools=pools, compile_saving=saving,
        )  # fmt: skip
        out[i] = simulated.model_copy(update={"host_peak": out[i].host_peak})
    return out
