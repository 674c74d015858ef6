"""What each FSDP engine does in a training step, written once: the estimators
(:mod:`autoshard.predict`), the trials' set-up (:mod:`autoshard.sharding`) and the emitters ask
the policy of the candidate's engine (:func:`policy_of`) instead of re-deriving it.

- FSDP1 (``FullyShardedDataParallel``): one flat parameter per unit, gathered straight into it;
  its sharding strategy alone decides what reshards after forward, and the root never does;
  gradients reduce in the compute dtype (Lightning's ``MixedPrecision``); ``no_sync`` skips the
  sync under any loop's accumulation; a world of one rank runs NO_SHARD; under CPU offload it
  keeps device copies of its host shards (every unit's under NO_SHARD and SHARD_GRAD_OP without
  parameter mixed precision) and every unit's reduced gradient until the backward ends.
- FSDP2 (``fully_shard``): per-parameter sharding, gathered into a buffer and copied out; the
  reshard policy decides per unit; gradients reduce in fp32 under mixed precision
  (``reduce_dtype_fp32``); frozen parameters carry no gradient; Lightning's Trainer reduces
  every micro-batch (no ``no_sync``).

>>> from autoshard.config import Candidate, Hardware
>>> policy_of(Candidate(engine="fsdp2")).reduce_bytes(Candidate(engine="fsdp2"))
4
>>> one = Hardware(gpus_per_node=1, gpu_memory=2**30)
>>> as_run(Candidate(), one).sharding.value  # FSDP1 on one rank switches to NO_SHARD
'NO_SHARD'
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from autoshard.config import (
    OPTIMIZER_TRAITS,
    SHARDING_TRAITS,
    BackwardPrefetch,
    Candidate,
    Engine,
    Hardware,
    Loop,
    OptimizerImpl,
    Precision,
    Reshard,
    ShardGroup,
    Sharding,
    ShardingTraits,
    WorkloadSpec,
)
from autoshard.errors import ConfigError
from autoshard.results import ModelProfile


class OffloadTransfers(NamedTuple):
    """The host-link copies of one rank's parameter shard in a step under CPU offload
    (:meth:`EnginePolicy.offload_transfers`), besides the gradient's one copy back."""

    to_device: int  # copies of the shard to the device
    hidden: bool  # copies run on their own stream beside the compute
    blocking_grads: bool  # the gradient's copy back blocks the host (and so the compute)


class OffloadCopies(Enum):
    """Which device copies of its offloaded host shards an engine keeps through a step
    (:meth:`EnginePolicy.offload_device_copies`)."""

    NONE = "none"  # freed as soon as they are gathered or cast
    COMPUTING = "computing"  # the root's through forward and backward, and the unit computing
    ALL = "all"  # every unit's, through forward and backward


def element_bytes(precision: Precision) -> tuple[int, int]:
    """(bytes of a stored parameter, bytes of the compute dtype)."""
    stored = 2 if precision is Precision.BF16_TRUE else 4
    compute = 4 if precision is Precision.FP32 else 2
    return stored, compute


def shard_group(candidate: Candidate, hardware: Hardware) -> tuple[int, int]:
    """(ranks a parameter is sharded over, replicas of each shard) of the candidate's sharding."""
    world = hardware.world_size
    match traits(candidate).group:
        case ShardGroup.NONE:
            return 1, world
        case ShardGroup.HYBRID:
            assert candidate.hybrid_mesh is not None
            replicas, shard = candidate.hybrid_mesh
            return shard, replicas
        case ShardGroup.WORLD:
            return world, 1
        case _:
            raise ValueError(f"unknown shard group of {candidate.sharding!r}")


def shard_size(candidate: Candidate, hardware: Hardware) -> int:
    """Ranks a parameter is sharded over."""
    return shard_group(candidate, hardware)[0]


def traits(candidate: Candidate) -> ShardingTraits:
    """What the candidate's sharding strategy does (its row of
    :data:`~autoshard.config.SHARDING_TRAITS`)."""
    return SHARDING_TRAITS[candidate.sharding]


def resharded_sharding(candidate: Candidate) -> bool:
    """Whether the sharding frees units after forward and gathers them again in backward."""
    return traits(candidate).reshards


def reshard_after_forward(candidate: Candidate, *, root: bool = False, last: bool = False) -> bool:
    """``fully_shard``'s ``reshard_after_forward`` for one unit: the root unit, the last block
    (the first that backward needs), or any other block.

    One rule for the trials and every output: a sharding that keeps units gathered
    (SHARD_GRAD_OP) is False everywhere. Otherwise ``candidate.reshard`` decides, NO_SHARD
    included: FSDP2 has no NO_SHARD, autoshard runs it on a (world, 1) mesh where each unit
    still gets a local unsharded copy, and freeing it after forward is what fully_shard does by
    default and what the trials measured (nothing is gathered over the network, so
    ``traits.reshards`` stays False for the estimators' collectives). ALL frees
    every unit after forward; KEEP_ROOT keeps the root (``fully_shard``'s default, ``None``, does
    this: backward needs the root's head first); KEEP_ROOT_AND_LAST also keeps the last block
    (torchtitan, ``torchtitan/models/llama3/infra/parallelize.py``: FSDP would prefetch it again
    at once when backward starts)."""
    if traits(candidate).keeps_gathered:
        return False
    match candidate.reshard:
        case Reshard.ALL:
            return True
        case Reshard.KEEP_ROOT:
            return not root
        case Reshard.KEEP_ROOT_AND_LAST:
            return not (root or last)
        case _:
            raise ConfigError(f"unknown reshard policy {candidate.reshard!r}")


class EnginePolicy:
    """The rules both engines share; :class:`FSDP1Policy` and :class:`FSDP2Policy` differ."""

    engine: Engine

    def as_run(self, candidate: Candidate, hardware: Hardware) -> Candidate:
        """The configuration the engine runs for ``candidate`` on ``hardware``."""
        return candidate

    def reduce_bytes(self, candidate: Candidate) -> int:
        """Bytes per gradient element in the reduction."""
        return element_bytes(candidate.precision)[1]

    def mesh_shape(self, candidate: Candidate, world_size: int) -> tuple[int, ...] | None:
        """The shape of the device mesh the engine shards ``candidate`` over, (replicate,
        shard) when it has two dimensions; None: the default process group."""
        raise NotImplementedError

    def regathers(self, candidate: Candidate, *, root: bool = False, last: bool = False) -> bool:
        """Whether backward gathers the unit again (it was freed after forward), sharded or not:
        the root unit, the last block, or another block."""
        raise NotImplementedError

    def keeps_after_forward(self, candidate: Candidate, root: int, unit: int) -> int:
        """Of a root of ``root`` and a last block of ``unit`` elements, those kept gathered from
        the loss's forward into backward (FULL_SHARD and HYBRID_SHARD)."""
        raise NotImplementedError

    def prefetches_backward(self, candidate: Candidate) -> bool:
        """Whether backward issues the next unit's all-gather before the current unit computes."""
        raise NotImplementedError

    def skips_gradient_sync(self, candidate: Candidate, workload: WorkloadSpec) -> bool:
        """Whether the micro-batches before the last keep unsharded gradients instead of
        reducing them (:mod:`autoshard.loop`)."""
        raise NotImplementedError

    def gradient_params(self, profile: ModelProfile, candidate: Candidate) -> tuple[int, int, int]:
        """The parameters that carry a gradient: (all, the root unit's, the largest block's)."""
        raise NotImplementedError

    def state_bytes(
        self, profile: ModelProfile, candidate: Candidate, shard: int, element: int
    ) -> int:
        """Bytes of one parameter-sized optimizer state of ``element`` bytes per element (its
        own dtype's) on the rank that holds the most (:func:`optimizer_bytes`)."""
        raise NotImplementedError

    def flat_views(self, candidate: Candidate, shard: int) -> bool:
        """Whether the optimizer steps flat 1-D views of the parameters rather than tensors of
        their own shapes (what a factoring optimizer factors)."""
        raise NotImplementedError

    def accumulated_gradient_bytes(self, profile: ModelProfile, candidate: Candidate) -> int:
        """Bytes of the unsharded gradients kept between micro-batches when the sync is
        skipped."""
        trained, _, _ = self.gradient_params(profile, candidate)
        return trained * self.reduce_bytes(candidate)

    def offload_device_copies(self, candidate: Candidate) -> OffloadCopies:
        """Under CPU offload, the device copies of the host shards that the engine keeps
        through a step (:class:`OffloadCopies`). FSDP2 gathers from its pinned shards and keeps
        none."""
        return OffloadCopies.NONE

    def offload_keeps_gradients(self, candidate: Candidate) -> bool:
        """Under CPU offload, whether the reduced gradients stay on the device from each unit's
        backward until the backward ends (then only the host's are left). FSDP2 copies each
        unit's to the host as it reduces it."""
        return False

    def host_pinned_bytes(self, profile: ModelProfile, candidate: Candidate, shard: int) -> int:
        """Under CPU offload, the pinned host bytes one rank holds beyond the optimizer's
        states (its shards and their host gradients); 0 where the estimate counts them as
        plain host bytes (FSDP2)."""
        return 0

    def offload_transfers(
        self, candidate: Candidate, shard: int, accumulate: int
    ) -> OffloadTransfers:
        """Under CPU offload, the copies of this rank's shard over the host link in one step
        (:class:`OffloadTransfers`). FSDP2: each gather copies the shard to the device (a
        second time in backward where units reshard), counted one after another with the
        gradient's copy back and nothing hidden."""
        regather = shard > 1 and traits(candidate).shards_params and resharded_sharding(candidate)
        return OffloadTransfers(accumulate * (1 + regather), hidden=False, blocking_grads=False)


class FSDP1Policy(EnginePolicy):
    engine = Engine.FSDP1

    def as_run(self, candidate: Candidate, hardware: Hardware) -> Candidate:
        """On a world of one rank every sharding strategy runs as NO_SHARD
        (``FullyShardedDataParallel`` warns and does so; parameters then stay whole, no
        unsharded copies are gathered)."""
        if hardware.world_size == 1 and candidate.sharding is not Sharding.NO_SHARD:
            return candidate.model_copy(update={"sharding": Sharding.NO_SHARD, "hybrid_mesh": None})
        return candidate

    def mesh_shape(self, candidate: Candidate, world_size: int) -> tuple[int, ...] | None:
        # the sharding strategy shards over the default group unless it has a hybrid mesh
        return candidate.hybrid_mesh if traits(candidate).needs_mesh else None

    def regathers(self, candidate: Candidate, *, root: bool = False, last: bool = False) -> bool:
        # the sharding strategy decides; the root is never resharded after forward
        return resharded_sharding(candidate) and not root

    def keeps_after_forward(self, candidate: Candidate, root: int, unit: int) -> int:
        return root

    def prefetches_backward(self, candidate: Candidate) -> bool:
        return candidate.backward_prefetch is BackwardPrefetch.BACKWARD_PRE

    def skips_gradient_sync(self, candidate: Candidate, workload: WorkloadSpec) -> bool:
        # ``no_sync`` under every loop (Lightning's Trainer uses it too)
        return workload.accumulate > 1

    def gradient_params(self, profile: ModelProfile, candidate: Candidate) -> tuple[int, int, int]:
        """A unit's flat parameter gets a gradient of its full size as soon as one of its
        parameters trains (``use_orig_params=True`` allows mixing; frozen entries are
        zero-filled), or none (measured on fake tensors: a frozen embedding in the root unit
        keeps the root's whole gradient)."""
        params = profile.total_params
        if candidate.one_unit:
            trained = params if profile.trainable_params else 0
            return trained, trained, 0
        root = profile.root_unit_params
        unit = max(profile.block_params, 1)
        trained_root = root if root > profile.root_frozen_params else 0
        blocks = max(profile.block_count, 1)
        trained_blocks = (params - root) * (blocks - profile.frozen_blocks) // blocks
        trains = profile.frozen_blocks < profile.block_count or not profile.block_count
        return trained_root + trained_blocks, trained_root, unit if trains else 0

    def state_bytes(
        self, profile: ModelProfile, candidate: Candidate, shard: int, element: int
    ) -> int:
        """Each unit's flat parameter is cut into equal contiguous shards, so with frozen
        parameters the ranks differ: a rank may hold a unit's whole trainable part, up to its
        shard of the unit (the tiny GPT with a frozen embedding: the rank holding the head keeps
        5.1 MiB of AdamW state, the one holding the embedding 3.1 MiB)."""
        if not profile.frozen_params:
            return profile.trainable_params * element // shard

        def largest(size: int, trainable: int) -> int:
            return min(max(trainable, 0), -(-size // shard))

        if candidate.one_unit or not profile.block_count:
            return largest(profile.total_params, profile.trainable_params) * element
        root = largest(
            profile.root_unit_params, profile.root_unit_params - profile.root_frozen_params
        )
        block = largest(profile.block_params, profile.block_params - profile.block_frozen_params)
        return (root + (profile.block_count - profile.frozen_blocks) * block) * element

    def flat_views(self, candidate: Candidate, shard: int) -> bool:
        """With ``use_orig_params=True`` the parameters of a sharded flat parameter are 1-D
        views into this rank's shard; unsharded (NO_SHARD, one rank) views of their own shapes
        (torch's Adafactor on the tiny GPT over 2 gloo ranks keeps 1.0 and 0.012 of the
        parameter bytes as state: benchmarks/results/optimizer_memory_cpu.md)."""
        return shard > 1

    def offload_device_copies(self, candidate: Candidate) -> OffloadCopies:
        """``FlatParamHandle.pre_unshard`` copies an offloaded unit's host shard to the device
        (``flat_param_to``) before each forward and backward of the unit, unless parameter
        mixed precision casts it instead (``_use_low_precision_shard``: the copy is freed at
        once). What keeps the copy (torch 2.11 and 2.13, ``_flat_param.py``): NO_SHARD's
        ``_use_sharded_views`` never clears the handle's saved views (``_tensors``), which
        point into it, so each unit's copy lives until its next unshard replaces it (the device
        holds a whole copy of the model, as without offload); SHARD_GRAD_OP skips the sharded
        views after forward, so the original parameters point into it until the unit's
        post-backward reshard (every shard from forward into backward); FULL_SHARD points the
        original parameters back at the host shard on every reshard (the root's copy lives
        through the whole forward and backward, a block's through its own)."""
        if candidate.precision.mixed:
            return OffloadCopies.NONE
        if not traits(candidate).reshards:
            return OffloadCopies.ALL
        return OffloadCopies.COMPUTING

    def offload_keeps_gradients(self, candidate: Candidate) -> bool:
        """A unit's reduced gradient, cast to the parameters' dtype, is copied to its host
        gradient (``_offload_grad``) and stays on the device (NO_SHARD: ``flat_param.grad``;
        sharded: ``_saved_grad_shard``) until the root's post-backward callback points the
        gradient at the host's (``prepare_gradient_for_optim``)."""
        return True

    def host_pinned_bytes(self, profile: ModelProfile, candidate: Candidate, shard: int) -> int:
        """Each unit's host shard and its host gradient (``_cpu_grad``, every unit's, trained or
        not) are pinned; the CUDA caching host allocator rounds each pinned block up to a power
        of two (``CachingHostAllocatorImpl::allocate``: ``PowerOf2Ceil``)."""
        stored, _ = element_bytes(candidate.precision)
        if candidate.one_unit or not profile.block_count:
            units = [profile.total_params]
        else:
            blocks = [profile.block_params] * profile.block_count
            units = [profile.root_unit_params, *blocks]
        shards = [-(-size // shard) * stored for size in units if size]
        return 2 * sum(1 << (size - 1).bit_length() for size in shards)

    def offload_transfers(
        self, candidate: Candidate, shard: int, accumulate: int
    ) -> OffloadTransfers:
        """Every micro-batch's forward and backward copy the unit's host shard to the device
        (``pre_unshard`` before each unshard, whatever the sharding), issued on the pre-unshard
        stream ahead of the compute that waits for them: hidden behind it. The gradient's
        copy back (``_offload_grad``) is asynchronous on the post-backward stream for sharded
        strategies and blocks the host under NO_SHARD ("Investigate why `NO_SHARD` breaks
        correctness when using `non_blocking=True` here", torch 2.11 and 2.13): there each
        unit's backward waits for the copy of the one before it."""
        return OffloadTransfers(
            2 * accumulate, hidden=True, blocking_grads=not traits(candidate).shards_params
        )


class FSDP2Policy(EnginePolicy):
    engine = Engine.FSDP2

    def reduce_bytes(self, candidate: Candidate) -> int:
        if candidate.precision.mixed and candidate.reduce_dtype_fp32:
            return 4
        return super().reduce_bytes(candidate)

    def mesh_shape(self, candidate: Candidate, world_size: int) -> tuple[int, ...] | None:
        # fully_shard has no strategy argument: the mesh's shard dimension is the shard group
        match traits(candidate).group:
            case ShardGroup.HYBRID:
                return candidate.hybrid_mesh
            case ShardGroup.NONE:
                return (world_size, 1)
            case _:
                return (world_size,)

    def regathers(self, candidate: Candidate, *, root: bool = False, last: bool = False) -> bool:
        return resharded_sharding(candidate) and reshard_after_forward(
            candidate, root=root, last=last
        )

    def keeps_after_forward(self, candidate: Candidate, root: int, unit: int) -> int:
        kept = 0 if reshard_after_forward(candidate, root=True) else root
        return kept + (0 if reshard_after_forward(candidate, last=True) else unit)

    def prefetches_backward(self, candidate: Candidate) -> bool:
        return True

    def skips_gradient_sync(self, candidate: Candidate, workload: WorkloadSpec) -> bool:
        # ``set_requires_gradient_sync(False)`` in a plain loop; Lightning's Trainer has no
        # ``no_sync`` for ``fully_shard`` modules and reduces every micro-batch
        return workload.accumulate > 1 and workload.loop == Loop.PLAIN

    def gradient_params(self, profile: ModelProfile, candidate: Candidate) -> tuple[int, int, int]:
        """Gradients are per parameter: frozen parameters carry none."""
        if candidate.one_unit:
            root = profile.total_params
            return profile.trainable_params, max(0, root - profile.frozen_params), 0
        root = profile.root_unit_params
        unit = max(profile.block_params, 1)
        return (
            profile.trainable_params,
            max(0, root - profile.root_frozen_params),
            max(0, unit - profile.block_frozen_params),
        )

    def state_bytes(
        self, profile: ModelProfile, candidate: Candidate, shard: int, element: int
    ) -> int:
        # every parameter is sharded evenly
        return profile.trainable_params * element // shard

    def flat_views(self, candidate: Candidate, shard: int) -> bool:
        # DTensors of the parameters' own shapes, sharded on their first dimension
        return False


_POLICIES: dict[Engine, EnginePolicy] = {Engine.FSDP1: FSDP1Policy(), Engine.FSDP2: FSDP2Policy()}


def policy_of(candidate: Candidate) -> EnginePolicy:
    """The policy of the engine that runs ``candidate``."""
    return _POLICIES[candidate.engine]


def as_run(candidate: Candidate, hardware: Hardware) -> Candidate:
    """The configuration the engine runs (:meth:`EnginePolicy.as_run`)."""
    return policy_of(candidate).as_run(candidate, hardware)


def reduce_bytes(candidate: Candidate) -> int:
    """Bytes per gradient element in the reduction (:meth:`EnginePolicy.reduce_bytes`)."""
    return policy_of(candidate).reduce_bytes(candidate)


def skips_gradient_sync(candidate: Candidate, workload: WorkloadSpec) -> bool:
    """Whether accumulation skips the sync before the last micro-batch: a plain loop does
    (FSDP1 ``no_sync``, FSDP2 ``set_requires_gradient_sync(False)``); Lightning's Trainer only
    for FSDP1 (:meth:`EnginePolicy.skips_gradient_sync`)."""
    return policy_of(candidate).skips_gradient_sync(candidate, workload)


def gradient_params(profile: ModelProfile, candidate: Candidate) -> tuple[int, int, int]:
    """The parameters that carry a gradient: (all, the root unit's, the largest block unit's)
    (:meth:`EnginePolicy.gradient_params`)."""
    return policy_of(candidate).gradient_params(profile, candidate)


def optimizer_bytes(profile: ModelProfile, candidate: Candidate, shard: int) -> tuple[int, int]:
    """(bytes of the optimizer's states on the rank that holds the most, bytes of the transient
    copies of its trainable shard a foreach step holds at once), from its row of
    :data:`~autoshard.config.OPTIMIZER_TRAITS`: parameter-sized states in their own dtype, or, for
    an optimizer that factors the tensors it gets shaped, their 1-D tensors whole and a row and a
    column vector of each other one."""
    policy = policy_of(candidate)
    row = OPTIMIZER_TRAITS[candidate.optimizer]
    stored, _ = element_bytes(candidate.precision)
    element = row.state_bytes or stored
    if row.factors_matrices and not policy.flat_views(candidate, shard):
        states = (profile.vector_params + profile.matrix_factor_params) * element // shard
    else:
        states = row.states * policy.state_bytes(profile, candidate, shard, element)
    if candidate.optimizer_impl is not OptimizerImpl.FOREACH:
        return states, 0
    return states, row.foreach_copies * policy.state_bytes(profile, candidate, shard, stored)
