"""A :class:`~autoshard.results.Recommendation` turned into the objects a training script uses: a
constructed Lightning ``FSDPStrategy`` (or ``ModelParallelStrategy`` for FSDP2) and the matching
Trainer arguments; the kwargs of torch's ``FullyShardedDataParallel``; an FSDP2 plan that
applies ``fully_shard`` and checkpointing.

Every FSDP argument comes from :mod:`autoshard.sharding`, the module trials run through, so what
autoshard measured and what it hands out cannot disagree. Lightning is imported only inside the
functions that need it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from autoshard import sharding
from autoshard.config import BackwardPrefetch, Candidate, Checkpointing, Engine, Precision, Sharding
from autoshard.errors import ConfigError, MissingDependencyError
from autoshard.units import format_bytes

if TYPE_CHECKING:  # annotations only: results imports emit (lazily), not the reverse
    from autoshard.results import Recommendation

StateDictType = Literal["full", "sharded"]

# A full state dict gathers every fp32 parameter (and Adam's two moments with the optimizer
# state) on rank 0's host memory. Above this size that takes minutes and tens of GiB per save.
_FULL_STATE_DICT_LIMIT = 8 * 2**30


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
# Choices that are not in the Candidate
# ---------------------------------------------------------------------------------------------


def choose_state_dict_type(rec: Recommendation) -> tuple[StateDictType, str]:
    """``"sharded"`` for big models, ``"full"`` otherwise; with the reason, for people."""
    full = rec.profile.total_params * 4  # fp32 master weights, gathered on rank 0
    limit = _FULL_STATE_DICT_LIMIT
    if rec.hardware.host_memory:
        limit = min(limit, rec.hardware.host_memory // 4)
    if full > limit:
        return "sharded", (
            f"state_dict_type=sharded: a full checkpoint would gather {format_bytes(full)} of "
            f"fp32 weights (plus optimizer state) on rank 0's host memory at every save"
        )
    return "full", (
        f"state_dict_type=full: the model's {format_bytes(full)} of fp32 weights gather on rank 0 "
        "quickly, and one file loads anywhere without FSDP"
    )


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
    rec: Recommendation, *, device: Any = None, model: nn.Module | None = None
) -> dict[str, Any]:
    """Keyword arguments for torch's ``FullyShardedDataParallel`` (FSDP1 engine).

    Pass ``model`` to look the wrap classes up among its modules (a model loaded from a file may
    not be importable by path). Checkpointing is applied after wrapping: call
    :func:`apply_checkpointing` on the wrapped model. For HYBRID_SHARD pass a ``device_mesh``
    yourself (``init_device_mesh("cuda", rec.chosen.candidate.hybrid_mesh)``).
    """
    c = rec.chosen.candidate
    if c.engine is not Engine.FSDP1:
        raise ConfigError("fsdp_kwargs(): the recommendation is for FSDP2; use fsdp2_plan()")
    classes = _classes(c.wrap_classes, model) if c.wrap_classes else None
    return sharding.fsdp1_kwargs(c, device=device, classes=classes)


def apply_checkpointing(model: nn.Module, rec: Recommendation) -> nn.Module:
    """Checkpoint the chosen blocks of ``model`` (after FSDP1 wrapping), in place."""
    sharding.apply_checkpointing(model, rec.chosen.candidate)
    return model


def fsdp2_plan(rec: Recommendation) -> Callable[..., nn.Module]:
    """A function ``plan(model, mesh=None)`` that checkpoints and ``fully_shard``s ``model``
    exactly as chosen. ``mesh`` may be Lightning's ``self.device_mesh["data_parallel"]``;
    None (or a 1-D mesh when the choice needs a 2-D one) builds the mesh over all ranks."""
    candidate = rec.chosen.candidate
    if candidate.engine is not Engine.FSDP2:
        raise ConfigError("fsdp2_plan(): the recommendation is for FSDP1; use fsdp_kwargs()")

    def plan(model: nn.Module, mesh: Any = None) -> nn.Module:
        import torch
        import torch.distributed as dist

        needs_2d = candidate.sharding in (Sharding.HYBRID_SHARD, Sharding.NO_SHARD)
        if mesh is None or (needs_2d and mesh.ndim == 1):
            device_type = (
                mesh.device_type
                if mesh is not None
                else ("cuda" if torch.cuda.is_available() else "cpu")
            )
            mesh = sharding.fsdp2_mesh(candidate, torch.device(device_type), dist.get_world_size())
        return sharding.apply_fsdp2(model, candidate, mesh)

    return plan


def trainer_kwargs(rec: Recommendation) -> dict[str, Any]:
    """The Trainer arguments that go with :func:`strategy`: precision, devices, num_nodes."""
    return {
        "precision": rec.chosen.candidate.precision.value,
        "devices": rec.hardware.gpus_per_node,
        "num_nodes": rec.hardware.nodes,
    }


def strategy_kwargs(rec: Recommendation, *, model: nn.Module | None = None) -> dict[str, Any]:
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
        "sharding_strategy": c.sharding.value,
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
    if ckpt is not None:
        kwargs["activation_checkpointing_policy"] = ckpt
    if fk["mixed_precision"] != _lightning_mixed_precision(c.precision):
        kwargs["mixed_precision"] = fk["mixed_precision"]
    if c.hybrid_mesh is not None:
        kwargs["device_mesh"] = tuple(c.hybrid_mesh)
    return kwargs


def strategy(rec: Recommendation, *, model: nn.Module | None = None) -> Any:
    """A constructed Lightning strategy for the chosen configuration.

    FSDP1: ``FSDPStrategy``; use it with ``Trainer(strategy=..., **trainer_kwargs(rec))``.
    FSDP2: ``ModelParallelStrategy``; apply ``fsdp2_plan(rec)`` in ``configure_model``.
    """
    _require_lightning("rec.strategy()")
    kwargs = strategy_kwargs(rec, model=model)
    if rec.chosen.candidate.engine is Engine.FSDP2:
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(**kwargs)
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(**kwargs)
