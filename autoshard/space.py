"""The search space: every FSDP configuration worth considering for a model on some hardware.

Dimensions that change memory are enumerated (sharding, activation checkpointing, CPU offload,
precision, micro-batch size, and for FSDP2 which units reshard after forward); knobs that only
trade a little speed (prefetch, all-gather limits) keep Lightning's defaults. The space stays
product-sized: tens of candidates, which the estimator scores in milliseconds and the search
tries in a handful of trials.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from autoshard.config import (
    OPTIMIZER_TRAITS,
    SHARDING_TRAITS,
    Candidate,
    Checkpointing,
    Engine,
    Frozen,
    Hardware,
    Optimizer,
    Precision,
    RankOrder,
    Reshard,
    Sharding,
    WorkloadSpec,
)
from autoshard.gpus import CATALOGUE, gpu_spec
from autoshard.ranking import (  # noqa: F401  (PREDICTED_TIE, predicted_tie: read here too)
    NEAR_LIMIT,
    PREDICTED_TIE,
    predicted_tie,
    rank_estimates,
    tie_rule_words,
)
from autoshard.results import MemoryEstimate, ModelProfile


def wrap_reason(candidate: Candidate, profile: ModelProfile) -> str:
    """One line on the candidate's units: FSDP1's auto_wrap_policy, or the modules FSDP2's
    ``fully_shard`` is applied to."""
    if Engine(candidate.engine) is Engine.FSDP2:
        if candidate.wrap_classes:
            units = ", ".join(candidate.wrap_classes)
            return f"fully_shard on each {{{units}}}, then the root: {profile.wrap_reason}"
        return (
            "fully_shard on the root only: the whole model is one FSDP unit, gathered at once; "
            "the fewest collectives, and it fits"
        )
    if candidate.wrap_classes:
        return f"auto_wrap_policy {{{', '.join(candidate.wrap_classes)}}}: {profile.wrap_reason}"
    if candidate.min_num_params:
        return (
            f"auto_wrap_policy min_num_params={candidate.min_num_params:,}: {profile.wrap_reason}"
        )
    return (
        "no auto_wrap_policy (Lightning's default): the whole model is one FSDP unit, gathered "
        "at once; the fewest collectives, and it fits"
    )


def default_precisions(hardware: Hardware) -> tuple[Precision, ...]:
    """bf16 mixed precision where the GPUs have bf16, fp16 mixed where not, and full fp32."""
    low = Precision.BF16_MIXED if hardware.bf16_supported else Precision.FP16_MIXED
    return (low, Precision.FP32)


BF16_COMPUTE = (Precision.BF16_MIXED, Precision.BF16_TRUE)
"""The precisions float8 training goes with: torchao's Float8Linear casts from bf16, and its
non-matmul ops stay in bf16."""


def fp8_gpus() -> str:
    """The catalogue's GPUs with fp8 tensor cores, for messages."""
    return ", ".join(sorted(i for i, spec in CATALOGUE.items() if spec.fp8_flops))


def float8_blocker(hardware: Hardware, engine: Engine | str) -> str | None:
    """Why float8 training cannot be planned for ``engine`` on ``hardware``; None when it can.

    >>> from autoshard import Hardware
    >>> from autoshard.space import float8_blocker
    >>> a100 = Hardware(gpus_per_node=8, gpu_memory=80 * 2**30, gpu="a100-80gb-sxm")
    >>> float8_blocker(a100, "fsdp2")[:51]
    'NVIDIA A100 SXM4 80GB has no fp8 tensor cores (fp8:'
    >>> h100 = a100.model_copy(update={"gpu": "h100-sxm"})
    >>> float8_blocker(h100, "fsdp2") is None, float8_blocker(h100, "fsdp1")[:21]
    (True, 'FSDP1 has no float8 a')
    """
    if Engine(engine) is Engine.FSDP1:
        return (
            "FSDP1 has no float8 all-gather (torchao's float8 weights hook into FSDP2's "
            "fully_shard): use engine fsdp2"
        )
    if hardware.backend == "gloo":
        return "CPU processes have no fp8 tensor cores"
    if hardware.gpu is None:
        return f"the GPU model is not known: give gpu (--gpu) as one of {fp8_gpus()}"
    spec = gpu_spec(hardware.gpu)
    if spec.fp8_flops is None:
        return f"{spec.name} has no fp8 tensor cores (fp8: {fp8_gpus()})"
    if not hardware.bf16_supported:
        return "these GPUs do not compute in bf16, which float8 training needs"
    return None


def shardings_for(
    hardware: Hardware, engine: Engine = Engine.FSDP1
) -> list[tuple[Sharding, tuple[int, int] | None]]:
    """Sharding strategies that make sense for the world, each with its mesh (each row of
    :data:`~autoshard.config.SHARDING_TRAITS` says from how many ranks and nodes: HYBRID_SHARD
    across several nodes, sharding within a node and replicating across nodes)."""
    options = [
        (sharding, traits.proposed_mesh(hardware))
        for sharding, traits in SHARDING_TRAITS.items()
        if traits.proposed_for(hardware)
    ]
    if hardware.world_size == 1 and Engine(engine) is Engine.FSDP1:
        # FSDP1 runs every strategy as NO_SHARD on one rank (engine.as_run): one is enough.
        # FSDP2's reshard-after-forward still differs there.
        return options[:1]
    return options


def reshards_for(
    engine: Engine, sharding: Sharding, *, wrapped: bool, offload: bool
) -> tuple[Reshard, ...]:
    """FSDP2's reshard policies that differ for this sharding: with one that reshards
    (FULL_SHARD, HYBRID_SHARD) and block units, every unit resharded, the root kept, or the root
    and the last block kept (SHARD_GRAD_OP and NO_SHARD keep or hold everything anyway; FSDP1
    has no such choice; CPU offload is the last resort for memory, where keeping units gathered
    defeats it)."""
    if (
        Engine(engine) is Engine.FSDP2
        and SHARDING_TRAITS[sharding].reshards
        and wrapped
        and not offload
    ):
        return tuple(Reshard)
    return (Reshard.ALL,)


class Knobs(Frozen):
    """What a caller fixes or narrows in the space (:func:`enumerate_candidates`); the rest the
    space derives from the model and the hardware."""

    engine: Engine = Engine.FSDP1
    # a setting of the workload, not searched: every candidate runs it
    optimizer: Optimizer = Optimizer.ADAMW
    precisions: tuple[Precision, ...] | None = None  # None: default_precisions(hardware)
    micro_batch_sizes: tuple[int, ...] | None = None  # None: the workload's
    offload: bool | None = None  # None: both
    reshards: tuple[Reshard, ...] | None = None  # None: every policy that differs (FSDP2)
    compiles: tuple[bool, ...] = (False,)
    float8s: tuple[bool, ...] = (False,)


def enumerate_candidates(
    profile: ModelProfile,
    hardware: Hardware,
    workload: WorkloadSpec,
    knobs: Knobs | None = None,
) -> list[Candidate]:
    """All candidates for ``profile`` on ``hardware``: the analyzer's wrap policy with every
    sharding strategy, checkpointing none / every 2nd block / op-level (selective) / every
    block, CPU offload (with FULL_SHARD only: it is the last resort), for FSDP2 each reshard
    policy (:func:`reshards_for`; ``knobs.reshards`` pins some), and each precision and
    micro-batch size; and the whole model as one unit (Lightning's default) with each sharding,
    precision and micro-batch size. Each of them with every ``knobs.compiles`` value
    (torch.compile off, on), and with every ``knobs.float8s`` value where float8 goes (FSDP2 and
    bf16 compute; the hardware is the caller's to check, :func:`float8_blocker`). All with
    ``knobs.optimizer`` in its first implementation (torch's foreach where it has one).

    >>> from autoshard import Hardware, TargetSpec, WorkloadSpec, analyze_target
    >>> from autoshard import enumerate_candidates
    >>> from autoshard.space import Knobs
    >>> profile, _ = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> candidates = enumerate_candidates(
    ...     profile, Hardware(gpus_per_node=8, nodes=2, gpu_memory=80 * 2**30),
    ...     WorkloadSpec(seq_len=128), Knobs(precisions=("bf16-mixed",), micro_batch_sizes=(1,)))
    >>> sorted({c.sharding.value for c in candidates})
    ['FULL_SHARD', 'HYBRID_SHARD', 'NO_SHARD', 'SHARD_GRAD_OP']
    >>> {c.hybrid_mesh for c in candidates if c.sharding.value == "HYBRID_SHARD"}
    {(2, 8)}
    >>> fsdp2 = enumerate_candidates(
    ...     profile, Hardware(gpus_per_node=8, gpu_memory=80 * 2**30), WorkloadSpec(seq_len=128),
    ...     Knobs(engine="fsdp2", precisions=("bf16-mixed",), micro_batch_sizes=(1,)))
    >>> sorted({c.reshard.value for c in fsdp2 if c.sharding.value == "FULL_SHARD"})
    ['all', 'keep_root', 'keep_root_and_last']
    """
    knobs = knobs or Knobs()
    engine, optimizer, reshards = knobs.engine, knobs.optimizer, knobs.reshards
    blocks = profile.checkpoint_policy
    checkpointing = _checkpointing_options(profile)
    offloads = [False, True] if knobs.offload is None else [knobs.offload]
    sizes = tuple(knobs.micro_batch_sizes or (workload.micro_batch_size,))
    steps = {"optimizer": optimizer, "optimizer_impl": OPTIMIZER_TRAITS[optimizer].impls[0]}
    out: list[Candidate] = []
    for precision in knobs.precisions or default_precisions(hardware):
        for sharding, mesh in shardings_for(hardware, engine):
            for ckpt, every in checkpointing:
                for off in offloads:
                    if off and not SHARDING_TRAITS[sharding].offloads:
                        continue
                    policies = reshards_for(
                        engine, sharding, wrapped=bool(profile.wrap_policy), offload=off
                    )
                    if reshards is not None and len(policies) > 1:
                        policies = tuple(Reshard(r) for r in reshards)
                    for reshard, mbs in itertools.product(policies, sizes):
                        out.append(
                            Candidate(
                                engine=engine,
                                wrap_classes=profile.wrap_policy,
                                min_num_params=profile.wrap_min_params,
                                checkpointing=ckpt,
                                checkpoint_every=every,
                                checkpoint_classes=blocks if ckpt is not Checkpointing.NONE else (),
                                sharding=sharding,
                                hybrid_mesh=mesh,
                                cpu_offload=off,
                                precision=precision,
                                micro_batch_size=mbs,
                                reshard=reshard,
                                **steps,
                            )
                        )
        if profile.wrap_policy or profile.wrap_min_params:
            out += _one_unit_candidates(hardware, engine, precision, sizes, steps)
    return _with_recipes(out, engine, knobs.compiles, knobs.float8s)


def _checkpointing_options(profile: ModelProfile) -> list[tuple[Checkpointing, int]]:
    """(checkpointing, every k-th block) to try: none, and where there are blocks every 2nd
    (from 4 blocks), op-level and every block."""
    checkpointing: list[tuple[Checkpointing, int]] = [(Checkpointing.NONE, 1)]
    if profile.checkpoint_policy:
        if profile.block_count >= 4:
            checkpointing.append((Checkpointing.EVERY_K, 2))
        # op-level (torchtitan's): between none and all in memory and in recompute
        checkpointing.append((Checkpointing.SELECTIVE, 1))
        checkpointing.append((Checkpointing.ALL, 1))
    return checkpointing


def _one_unit_candidates(
    hardware: Hardware,
    engine: Engine,
    precision: Precision,
    sizes: Sequence[int],
    steps: dict[str, Any],
) -> list[Candidate]:
    """Lightning's default FSDPStrategy(): no wrap policy, the whole model one unit. It gathers
    everything at once (the estimate rules it out for large models) but has the fewest
    collectives: measured faster than per-block units on a small model."""
    return [
        Candidate(
            engine=engine, sharding=sharding, hybrid_mesh=mesh,
            precision=precision, micro_batch_size=mbs, **steps,
        )
        for sharding, mesh in shardings_for(hardware, engine)
        for mbs in sizes
    ]  # fmt: skip


def _with_recipes(
    candidates: list[Candidate],
    engine: Engine,
    compiles: Sequence[bool],
    float8s: Sequence[bool],
) -> list[Candidate]:
    """Each candidate with every ``compiles`` value, and every ``float8s`` value where float8
    goes (FSDP2 and bf16 compute)."""
    return [
        c.model_copy(update={"compile": compiled, "float8": f8}) if compiled or f8 else c
        for c in candidates
        for compiled in compiles
        for f8 in float8s
        if not f8 or (Engine(engine) is Engine.FSDP2 and c.precision in BF16_COMPUTE)
    ]


def predicted_rate(estimate: MemoryEstimate) -> float:
    """Predicted samples/s of all ranks (0 where the step-time model made no prediction)."""
    return estimate.speed.samples_per_s if estimate.speed is not None else 0.0


def rank_candidates(
    estimates: Sequence[MemoryEstimate],
    by: RankOrder | str = RankOrder.SPEED,
    *,
    host_memory_checked: bool = False,
) -> list[MemoryEstimate]:
    """Fitting candidates first: by the decision's rule (:func:`autoshard.ranking.ranked`: the
    fastest predicted, unless it is at risk and a candidate within :data:`PREDICTED_TIE` of it
    is not); or with ``by="headroom"`` the most headroom first. Then the rest by how far they
    overshoot. ``host_memory_checked``: whether the estimates checked offload's host memory
    (a host memory was given); unchecked, offloading is a risk.

    One order for every door: ``recommend``, ``estimate``, export and the study's trial order."""
    order = RankOrder(by)
    fits = [e for e in estimates if e.fits]
    rest = sorted((e for e in estimates if not e.fits), key=lambda e: -e.headroom)
    if order is RankOrder.HEADROOM:
        return sorted(fits, key=lambda e: -e.headroom) + rest
    return rank_estimates(fits, host_memory_checked=host_memory_checked) + rest
