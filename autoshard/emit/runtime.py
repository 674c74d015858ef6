"""A :class:`~autoshard.results.Decision` turned into the objects a training script uses: the
model with the whole configuration applied (:func:`apply`); a constructed Lightning (Trainer or
Fabric) ``FSDPStrategy`` (or ``ModelParallelStrategy`` for FSDP2) and the matching Trainer
arguments; the kwargs of torch's ``FullyShardedDataParallel``; an FSDP2 plan that applies
``fully_shard`` and checkpointing.

Every FSDP argument comes from :mod:`autoshard.sharding`, the module trials run through, so what
autoshard measured and what it hands out cannot disagree. Lightning is imported only inside the
functions that need it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from autoshard import sharding
from autoshard.config import BackwardPrefetch, Candidate, Checkpointing, Engine, Precision
from autoshard.emit.prose import Stack, choose_state_dict_type, kv_cache_note, selective_note
from autoshard.engine import traits
from autoshard.errors import ConfigError, HandoverNotice, MissingDependencyError
from autoshard.results import Decision


class EveryKthPolicy(ModuleWrapPolicy):
    """A ModuleWrapPolicy that keeps only every k-th instance of its classes, in module order.

    It selects blocks for activation checkpointing exactly as :func:`sharding.apply_checkpointing`
    does (block i is checkpointed when ``i % every == 0``). Lightning accepts it as
    ``activation_checkpointing_policy`` and the CLI builds it from ``class_path``.
    """

    def __init__(self, module_classes: list[type[nn.Module]], every: int = 1) -> None:
        super().__init__(set(module_classes))
        if every < 1:
            raise ValueError("every must be >= 1")
        self.every = every

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        chosen = super()._run_policy(root_module, ignored_modules, root_kwargs)
        blocks = [m for m in root_module.modules() if m in chosen]
        return {m: chosen[m] for m in blocks[:: self.every]}


# ---------------------------------------------------------------------------------------------
# The classes the candidate names, as Lightning takes them
# ---------------------------------------------------------------------------------------------


def _checkpoint_policy(candidate: Candidate, classes: set[type[nn.Module]]) -> Any:
    if candidate.checkpointing is Checkpointing.NONE:
        return None
    if candidate.checkpointing is Checkpointing.EVERY_K and candidate.checkpoint_every > 1:
        return EveryKthPolicy(sorted(classes, key=_path), candidate.checkpoint_every)
    return classes


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _classes(paths: tuple[str, ...], model: nn.Module | None) -> set[type[nn.Module]]:
    if not paths:
        return set()
    return (
        sharding.wrap_classes_of(model, paths)
        if model is not None
        else sharding.resolve_classes(paths)
    )


def _require_lightning(feature: str) -> None:
    try:
        import lightning.pytorch  # noqa: F401
    except ImportError:
        raise MissingDependencyError("lightning", feature, extra="lightning") from None


def _lightning_mixed_precision(precision: Precision) -> Any:
    """The MixedPrecision Lightning's Trainer(precision=...) gives FSDP by itself."""
    from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision

    return FSDPPrecision(precision.value).mixed_precision_config


# ---------------------------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------------------------


def fsdp_kwargs(
    rec: Decision, *, device: Any = None, model: nn.Module | None = None
) -> dict[str, Any]:
    """Keyword arguments for torch's ``FullyShardedDataParallel`` (FSDP1 engine): wrapping,
    sharding, mixed precision, offload, prefetch and all-gather limits, as the trials passed them.

    They do not checkpoint: activation checkpointing is applied after wrapping, by
    :func:`apply_checkpointing` (or use :func:`apply`, which does both, in the trials' order).
    ``device`` defaults to this rank's device (its CUDA device, or the CPU where there is none:
    FSDP1 on CPU processes needs ``device_id=cpu``). Pass ``model`` to look the wrap classes up
    among its modules (a model loaded from a file may not be importable by path). For
    HYBRID_SHARD pass a ``device_mesh`` yourself
    (``init_device_mesh("cuda", rec.chosen.candidate.hybrid_mesh)``).
    """
    c = rec.chosen.candidate
    if c.engine is not Engine.FSDP1:
        raise ConfigError("fsdp_kwargs(): the recommendation is for FSDP2; use fsdp2_plan()")
    classes = _classes(c.wrap_classes, model) if c.wrap_classes else None
    device = sharding.rank_device() if device is None else device
    return sharding.fsdp1_kwargs(c, device=device, classes=classes)


def apply_checkpointing(model: nn.Module, rec: Decision) -> nn.Module:
    """Checkpoint the chosen blocks of ``model`` (after FSDP1 wrapping), in place."""
    sharding.apply_checkpointing(model, rec.chosen.candidate)
    return model


def apply(rec: Decision, model: nn.Module) -> nn.Module:
    """``model`` with the whole chosen configuration applied, as the trials applied it
    (:func:`autoshard.sharding.apply_candidate`): FSDP1 wrapping, sharding, mixed precision,
    offload, prefetch and all-gather limits, then activation checkpointing; or FSDP2's
    float8 conversion, checkpointing, torch.compile of each block, then ``fully_shard`` of each
    block and the root with the reshard policy, on the chosen mesh (HYBRID_SHARD's (replicate,
    shard) mesh included); FSDP1's torch.compile is of the wrapped model. Returns the model to
    train; build the optimizer on its parameters afterwards (:func:`optimizer` builds the one
    the trials ran).

    The process group is yours (``torch.distributed.init_process_group()``, e.g. under
    ``torchrun``); the device is this rank's CUDA device with NCCL, or the CPU with gloo, and one
    :class:`~autoshard.errors.HandoverNotice` (rank 0) says which. The micro-batch size and the
    step's autocast (:meth:`Recommendation.autocast`) stay the training loop's.
    """
    import torch.distributed as dist

    c = rec.chosen.candidate
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "rec.apply() needs a process group: call torch.distributed.init_process_group() "
            "first (run under torchrun; backend nccl on GPUs, gloo on CPU)"
        )
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(
            "rec.apply(): the model's parameters are on the meta device; build it on the CPU "
            "(or load its weights) first"
        )
    device = sharding.rank_device()
    world = dist.get_world_size()
    if device.type == "cpu" and c.engine is Engine.FSDP1 and c.cpu_offload:
        raise ConfigError(
            "rec.apply(): FSDP1 with CPU offload needs a GPU (torch cannot run it on CPU "
            "processes); run it on the GPUs it was planned for"
        )
    if c.hybrid_mesh is not None and c.hybrid_mesh[0] * c.hybrid_mesh[1] != world:
        raise ConfigError(
            f"rec.apply(): the {c.sharding.value} mesh {c.hybrid_mesh[0]} x {c.hybrid_mesh[1]} "
            f"needs {c.hybrid_mesh[0] * c.hybrid_mesh[1]} ranks; this process group has {world}"
        )
    checkpointed = c.checkpoint_classes if c.checkpointing is not Checkpointing.NONE else ()
    for what, paths in (("wraps", c.wrap_classes), ("checkpoints", checkpointed)):
        classes = tuple(sharding.wrap_classes_of(model, paths)) if paths else ()
        if paths and not any(isinstance(m, classes) for m in model.modules()):
            raise ConfigError(
                f"rec.apply(): the recommendation {what} {', '.join(paths)}, which this model "
                f"({type(model).__name__}) does not contain; is it the model autoshard planned?"
            )
    if dist.get_rank() == 0:
        warnings.warn(_apply_notice(rec, device, world), HandoverNotice, stacklevel=3)
    return sharding.apply_candidate(model, c, device)


def _apply_notice(rec: Decision, device: Any, world: int) -> str:
    import torch.distributed as dist

    c = rec.chosen.candidate
    where = (
        f"each rank's CUDA device ({dist.get_backend()})"
        if device.type == "cuda"
        else "the CPU of each rank (gloo; no CUDA device here, so FSDP runs on the CPU)"
    )
    line = (
        f"rec.apply(): {c.label()} on {where}, {world} ranks (a micro-batch of "
        f"{c.micro_batch_size} per rank is your loader's)"
    )
    if c.compile:
        line += (
            "; torch.compile "
            + ("on each block" if c.engine is Engine.FSDP2 else "on the wrapped model")
            + ": the first step compiles"
        )
    if c.float8:
        line += (
            "; float8 linears: call torchao.float8.precompute_float8_dynamic_scale_for_fsdp"
            "(model) after each optimizer.step() (one all-reduce of the scales, as the trials)"
        )
    if world != rec.hardware.world_size:
        line += (
            f"; planned for {rec.hardware.world_size} ranks, so each rank's memory differs "
            "from the plan"
        )
    return line


def optimizer(rec: Decision, params: Iterable[nn.Parameter], *, lr: float) -> Any:
    """The optimizer the trials built over ``params`` (the parameters of the model
    :func:`apply` returned): its class, arguments and foreach / fused / for-loop choice
    (:func:`autoshard.sharding.make_optimizer`, whose row of
    :data:`~autoshard.config.OPTIMIZER_TRAITS` the estimates counted), with your ``lr``."""
    return sharding.make_optimizer(params, rec.chosen.candidate, lr=lr)


def autocast(rec: Decision) -> Any:
    """The autocast context each forward and loss ran under in the trials (Lightning's precision
    plugin does the same): ``torch.autocast`` in the compute dtype under bf16-mixed / 16-mixed,
    disabled otherwise; on this rank's device."""
    from autoshard.loop import autocast_for

    return autocast_for(rec.chosen.candidate, sharding.rank_device())


def fsdp2_plan(rec: Decision) -> Callable[..., nn.Module]:
    """A function ``plan(model, mesh=None)`` that checkpoints and ``fully_shard``s ``model``
    exactly as chosen. ``mesh`` may be Lightning's ``self.device_mesh["data_parallel"]``;
    None (or a 1-D mesh when the choice needs a 2-D one) builds the mesh over all ranks."""
    candidate = rec.chosen.candidate
    if candidate.engine is not Engine.FSDP2:
        raise ConfigError("fsdp2_plan(): the recommendation is for FSDP1; use fsdp_kwargs()")

    def plan(model: nn.Module, mesh: Any = None) -> nn.Module:
        import torch
        import torch.distributed as dist

        needs_2d = traits(candidate).replicates  # a (replicate, shard) mesh
        if mesh is None or (needs_2d and mesh.ndim == 1):
            device_type = (
                mesh.device_type
                if mesh is not None
                else ("cuda" if torch.cuda.is_available() else "cpu")
            )
            mesh = sharding.mesh_for(candidate, torch.device(device_type), dist.get_world_size())
        return sharding.apply_fsdp2(model, candidate, mesh)

    return plan


def trainer_kwargs(rec: Decision) -> dict[str, Any]:
    """The Trainer arguments that go with :func:`strategy`: precision, devices, num_nodes."""
    return {
        "precision": rec.chosen.candidate.precision.value,
        "devices": rec.hardware.gpus_per_node,
        "num_nodes": rec.hardware.nodes,
    }


def strategy_kwargs(rec: Decision, *, model: nn.Module | None = None) -> dict[str, Any]:
    """The arguments of Lightning's strategy class (FSDPStrategy or ModelParallelStrategy)."""
    c = rec.chosen.candidate
    state_dict_type, _ = choose_state_dict_type(rec)
    if c.engine is Engine.FSDP2:
        return {
            "data_parallel_size": rec.hardware.world_size,
            "tensor_parallel_size": 1,
            "save_distributed_checkpoint": state_dict_type == "sharded",
        }
    _require_lightning("rec.strategy()")
    wrap = _classes(c.wrap_classes, model)
    # Everything except the wrap policy and device comes from sharding.fsdp1_kwargs, the dict the
    # trials ran with; Lightning names some of its keys, the rest pass through **kwargs.
    fk = sharding.fsdp1_kwargs(c, classes=wrap or None)
    kwargs: dict[str, Any] = {
        "sharding_strategy": traits(c).fsdp1_name,
        "cpu_offload": c.cpu_offload,
        "state_dict_type": state_dict_type,
        "limit_all_gathers": fk["limit_all_gathers"],
        "forward_prefetch": fk["forward_prefetch"],
        "use_orig_params": fk["use_orig_params"],
    }
    # Left out when it is FSDP's default, as in the YAML (which cannot carry the enum).
    if c.backward_prefetch is not BackwardPrefetch.BACKWARD_PRE:
        kwargs["backward_prefetch"] = fk["backward_prefetch"]
    if wrap:
        kwargs["auto_wrap_policy"] = wrap
    elif "auto_wrap_policy" in fk:
        kwargs["auto_wrap_policy"] = fk["auto_wrap_policy"]
    ckpt = _checkpoint_policy(c, _classes(c.checkpoint_classes, model))
    if note := selective_note(c, Stack.LIGHTNING):
        warnings.warn(note, HandoverNotice, stacklevel=3)
    if note := kv_cache_note(rec, Stack.LIGHTNING):
        warnings.warn(note, HandoverNotice, stacklevel=3)
    if ckpt is not None:
        kwargs["activation_checkpointing_policy"] = ckpt
    if fk["mixed_precision"] != _lightning_mixed_precision(c.precision):
        kwargs["mixed_precision"] = fk["mixed_precision"]
    if c.hybrid_mesh is not None:
        kwargs["device_mesh"] = tuple(c.hybrid_mesh)
    return kwargs


def strategy(rec: Decision, *, model: nn.Module | None = None, fabric: bool = False) -> Any:
    """A constructed Lightning strategy for the chosen configuration.

    FSDP1: ``FSDPStrategy``; use it with ``Trainer(strategy=..., **trainer_kwargs(rec))``.
    FSDP2: ``ModelParallelStrategy``; apply ``fsdp2_plan(rec)`` in ``configure_model``.
    ``fabric=True``: Lightning Fabric's own classes (``lightning.fabric.strategies``), for
    ``Fabric(strategy=..., **trainer_kwargs(rec))``: the same FSDP1 arguments, or FSDP2's
    ``ModelParallelStrategy`` whose ``parallelize_fn`` applies the plan on Fabric's data-parallel
    mesh (``fabric.setup`` calls it).
    """
    _require_lightning("rec.strategy()")
    kwargs = strategy_kwargs(rec, model=model)
    fsdp2 = rec.chosen.candidate.engine is Engine.FSDP2
    if fabric:
        from lightning.fabric import strategies as fabric_strategies

        if fsdp2:
            return fabric_strategies.ModelParallelStrategy(
                parallelize_fn=_DataParallelPlan(fsdp2_plan(rec)), **kwargs
            )
        return fabric_strategies.FSDPStrategy(**kwargs)
    if fsdp2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(**kwargs)
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(**kwargs)


class _DataParallelPlan:
    """Fabric's ``parallelize_fn(model, device_mesh)``: the plan on the mesh's data-parallel
    dimension (Fabric's mesh is 2-D, (data_parallel, tensor_parallel); FSDP2 would read a 2-D
    mesh as replicate x shard)."""

    def __init__(self, plan: Callable[..., nn.Module]) -> None:
        self.plan = plan

    def __call__(self, model: nn.Module, device_mesh: Any) -> nn.Module:
        return self.plan(model, device_mesh["data_parallel"])
