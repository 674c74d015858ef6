"""The one place where a :class:`~autoshard.config.Candidate` becomes FSDP.

Trials, the emitted FSDP1 kwargs and the emitted FSDP2 plan all come from here, so what autoshard
measured and what it hands the user cannot disagree.

FSDP1 is set up exactly as Lightning's ``FSDPStrategy`` does it (lightning 2.6,
``lightning/fabric/strategies/fsdp.py``): ``use_orig_params=True``; ``MixedPrecision`` with
param, reduce and buffer dtypes all equal to the precision's dtype (Lightning's
``FSDPPrecision.mixed_precision_config``: it reduces in bf16 under ``bf16-mixed``);
``CPUOffload(offload_params=...)``; a set of classes becomes ``ModuleWrapPolicy``; activation
checkpointing is applied after wrapping with ``apply_activation_checkpointing``.

FSDP2 follows torchtitan: checkpoint the blocks, ``fully_shard`` each block, then the root;
``reshard_after_forward=False`` for SHARD_GRAD_OP, and per unit as ``candidate.reshard`` says
otherwise (:func:`reshard_after_forward`); HYBRID_SHARD and NO_SHARD on a 2-D (replicate, shard)
mesh (:func:`mesh_for`); gradients reduced in fp32 under mixed precision. ``candidate.float8``
converts the blocks' linear layers to torchao's ``Float8Linear`` first, and
``candidate.compile`` compiles each block in place before ``fully_shard`` (torchtitan's order:
float8, checkpointing, compile, FSDP); FSDP1 compiles the wrapped model.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autoshard.config import (
    OPTIMIZER_TRAITS,
    BackwardPrefetch,
    Candidate,
    Checkpointing,
    Engine,
    Precision,
)
from autoshard.engine import policy_of, reshard_after_forward, traits
from autoshard.errors import ConfigError, MissingDependencyError

_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.BF16_MIXED: torch.bfloat16,
    Precision.FP16_MIXED: torch.float16,
    Precision.BF16_TRUE: torch.bfloat16,
}


def compute_dtype(precision: Precision) -> torch.dtype:
    """The dtype the forward and backward compute in."""
    return _DTYPES[precision]


def resolve_classes(paths: Iterable[str]) -> set[type[nn.Module]]:
    """Import ``module.QualName`` class paths; a path that does not import is a ConfigError."""
    classes: set[type[nn.Module]] = set()
    for path in paths:
        module_name, _, qualname = path.rpartition(".")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(
                f"cannot import class {path!r} ({type(exc).__name__}: {exc}); is the model's "
                "module importable here (run from the folder of the model file)?"
            ) from exc
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            raise ConfigError(f"{path!r} is not an nn.Module class")
        classes.add(obj)
    return classes


def wrap_classes_of(model: nn.Module, paths: Iterable[str]) -> set[type[nn.Module]]:
    """The classes named by ``paths``, looked up among the model's own modules first.

    A model loaded from a file or a saved object may not be importable by path in this process,
    but its module classes are right there; fall back to importing for what is not found.
    """
    wanted = set(paths)
    found = {
        type(m) for m in model.modules() if f"{type(m).__module__}.{type(m).__qualname__}" in wanted
    }
    missing = wanted - {f"{c.__module__}.{c.__qualname__}" for c in found}
    return found | (resolve_classes(missing) if missing else set())


# ---------------------------------------------------------------------------------------------
# FSDP1
# ---------------------------------------------------------------------------------------------


def fsdp1_kwargs(
    candidate: Candidate,
    *,
    device: torch.device | None = None,
    classes: set[type[nn.Module]] | None = None,
    device_mesh: Any | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``FullyShardedDataParallel``, as Lightning's FSDPStrategy passes
    them. ``classes`` are the wrap classes (resolved from ``candidate.wrap_classes`` when None)."""
    from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    if candidate.engine is not Engine.FSDP1:
        raise ConfigError("fsdp1_kwargs needs an fsdp1 candidate")
    dtype = compute_dtype(candidate.precision)
    kwargs: dict[str, Any] = {
        "sharding_strategy": ShardingStrategy[traits(candidate).fsdp1_name],
        "cpu_offload": CPUOffload(offload_params=candidate.cpu_offload),
        "mixed_precision": MixedPrecision(
            param_dtype=dtype,
            reduce_dtype=torch.float32 if candidate.reduce_dtype_fp32 else dtype,
            buffer_dtype=dtype,
        ),
        "use_orig_params": True,
        "limit_all_gathers": candidate.limit_all_gathers,
        "forward_prefetch": candidate.forward_prefetch,
        "backward_prefetch": (
            None
            if candidate.backward_prefetch is BackwardPrefetch.NONE
            else TorchBackwardPrefetch[candidate.backward_prefetch.value]
        ),
    }
    if candidate.wrap_classes:
        wrap = classes if classes is not None else resolve_classes(candidate.wrap_classes)
        kwargs["auto_wrap_policy"] = ModuleWrapPolicy(wrap)
    elif candidate.min_num_params:
        kwargs["auto_wrap_policy"] = partial(
            size_based_auto_wrap_policy, min_num_params=candidate.min_num_params
        )
    if device is not None:
        kwargs["device_id"] = device
    if device_mesh is not None:
        kwargs["device_mesh"] = device_mesh
    return kwargs


def apply_fsdp1(
    model: nn.Module,
    candidate: Candidate,
    device: torch.device,
    *,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    use_orig_params: bool = True,
    mesh: Any | None = None,
) -> nn.Module:
    """Wrap ``model`` with FSDP1 and checkpoint its blocks, in Lightning's order.
    (``use_orig_params=False`` and a ready ``mesh``: for the simulation, see
    :mod:`autoshard.simulate`.)"""
    from torch.distributed.fsdp import FullyShardedDataParallel

    classes = wrap_classes_of(model, candidate.wrap_classes) if candidate.wrap_classes else None
    if mesh is None:
        mesh = mesh_for(candidate, device, dist.get_world_size())
    kwargs = fsdp1_kwargs(candidate, device=device, classes=classes, device_mesh=mesh)
    if param_init_fn is not None:
        kwargs["param_init_fn"] = param_init_fn
    kwargs["use_orig_params"] = use_orig_params
    wrapped = FullyShardedDataParallel(model, **kwargs)
    apply_checkpointing(wrapped, candidate)
    if candidate.compile:
        # The wrapped model as a whole, as Lightning (torch.compile of the module before fit) and
        # accelerate (after wrapping) do; FSDP1's hooks graph-break, the rest compiles.
        wrapped.compile()
    return wrapped


# ---------------------------------------------------------------------------------------------
# The whole candidate, on this rank's device
# ---------------------------------------------------------------------------------------------


def rank_device() -> torch.device:
    """The device this rank trains on: its local rank's CUDA device (made the current one) when
    CUDA is there and the process group, if there is one yet, speaks NCCL; else the CPU."""
    initialised = dist.is_available() and dist.is_initialized()
    if torch.cuda.is_available() and (not initialised or "nccl" in str(dist.get_backend())):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def apply_candidate(
    model: nn.Module,
    candidate: Candidate,
    device: torch.device,
    *,
    param_init_fn: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Apply the whole candidate to ``model`` on ``device``, as every trial does: bf16-true casts
    the model first; FSDP1 wraps, then checkpoints, then compiles (:func:`apply_fsdp1`); FSDP2
    converts to float8, checkpoints, compiles each block, then ``fully_shard``s on the
    candidate's mesh (:func:`apply_fsdp2`) and moves the rest to ``device``.
    ``param_init_fn(module)`` materialises a model built on meta, module by module. Needs an
    initialised process group."""
    if candidate.precision is Precision.BF16_TRUE:
        model = model.to(torch.bfloat16)
    if candidate.engine is Engine.FSDP1:
        return apply_fsdp1(model, candidate, device, param_init_fn=param_init_fn)
    mesh = mesh_for(candidate, device, dist.get_world_size())
    model = apply_fsdp2(model, candidate, mesh)
    if param_init_fn is not None:
        model.to_empty(device=device)
        for module in model.modules():
            param_init_fn(module)
    elif device.type != "cpu":
        model.to(device)
    return model


# ---------------------------------------------------------------------------------------------
# FSDP2
# ---------------------------------------------------------------------------------------------


def mesh_for(candidate: Candidate, device: torch.device, world_size: int) -> Any:
    """The device mesh ``candidate`` shards over, of the shape its engine's policy gives
    (:meth:`~autoshard.engine.EnginePolicy.mesh_shape`), made before the model is wrapped (the
    simulation makes it outside its fake mode): FSDP2's always, 1-D (shard) or 2-D (replicate,
    shard); FSDP1's for a hybrid mesh only (None: FSDP1 takes the default process group)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = policy_of(candidate).mesh_shape(candidate, world_size)
    if shape is None:
        return None
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(device.type, tuple(shape), mesh_dim_names=names)


def fsdp2_kwargs(candidate: Candidate, mesh: Any, *, pin_memory: bool) -> dict[str, Any]:
    """Keyword arguments for ``fully_shard`` of a block unit (the root and the last block take
    their ``reshard_after_forward`` from :func:`reshard_after_forward`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward(candidate),
    }
    if candidate.precision.mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype(candidate.precision),
            reduce_dtype=torch.float32 if candidate.reduce_dtype_fp32 else None,
        )
    if candidate.cpu_offload:
        # pin_memory needs CUDA; on a CPU-only build pinning fails (design notes).
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    return kwargs


def cpu_workers_cannot_run(candidate: Candidate) -> str | None:
    """Why trial workers on CPU processes (gloo, no GPU) cannot run ``candidate``; None if they
    can. FSDP1's CPU offload moves its parameters to the accelerator in the root's pre-forward
    and raises "Cannot access accelerator device when none is available" (torch 2.13); FSDP2's
    offload runs (unpinned) on CPU processes. float8 is a GPU's tensor-core format: a CPU
    emulates its matmuls, so a CPU trial would time the emulation, not what float8 is for."""
    if candidate.engine is Engine.FSDP1 and candidate.cpu_offload:
        return (
            "FSDP1's CPU offload needs a GPU: CPU workers cannot try it (torch cannot run it on "
            "CPU processes); its memory is the estimate's"
        )
    if candidate.float8:
        return (
            "float8 needs fp8 tensor cores: CPU workers have none (a CPU trial would time an "
            "emulation); its speed and memory are the estimate's"
        )
    if candidate.compile and (why := cpu_compiler_missing()):
        return f"{why}; its speed and memory are the estimate's"
    return None


@functools.cache
def cpu_compiler_missing() -> str | None:
    """Why inductor cannot compile for CPU processes here (it builds C++ kernels: it needs a
    C++ compiler); None when it can. Looked up once: importing inductor takes seconds."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # inductor's own error says which compilers it looked for
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"torch.compile on CPU processes needs a C++ compiler for inductor ({first})"
    return None


def apply_fsdp2(model: nn.Module, candidate: Candidate, mesh: Any) -> nn.Module:
    """Convert to float8 (:func:`apply_float8`), checkpoint the blocks, compile each wrap unit,
    then ``fully_shard`` each wrap unit and the root, in place, each with its
    ``reshard_after_forward`` (:func:`reshard_after_forward`)."""
    from torch.distributed.fsdp import fully_shard

    if candidate.engine is not Engine.FSDP2:
        raise ConfigError("apply_fsdp2 needs an fsdp2 candidate")
    # torchtitan's order: float8 conversion, checkpointing, compile, then fully_shard.
    apply_float8(model, candidate)
    apply_checkpointing(model, candidate)
    kwargs = fsdp2_kwargs(candidate, mesh, pin_memory=torch.cuda.is_available())
    classes = wrap_classes_of(model, candidate.wrap_classes) if candidate.wrap_classes else set()
    units = [
        module
        for module in model.modules()
        if module is not model
        and isinstance(_unwrap_checkpoint(module), tuple(classes))
        and module is _unwrap_checkpoint(module)
    ]
    if candidate.compile:
        # Each block by itself, as torchtitan does (repeated blocks compile once); the model
        # as a whole where it is one unit. In place (nn.Module.compile): parameter names and the
        # state dict stay the eager model's.
        for module in units or [model]:
            module.compile()
    # Module order: for a ModuleList of blocks, the order they run in; the last runs last.
    for i, module in enumerate(units):
        reshard = reshard_after_forward(candidate, last=i == len(units) - 1)
        fully_shard(module, **{**kwargs, "reshard_after_forward": reshard})
    fully_shard(
        model, **{**kwargs, "reshard_after_forward": reshard_after_forward(candidate, root=True)}
    )
    return model


def _unwrap_checkpoint(module: nn.Module) -> nn.Module:
    inner = getattr(module, "_checkpoint_wrapped_module", None)
    return inner if isinstance(inner, nn.Module) else module


# ---------------------------------------------------------------------------------------------
# Activation checkpointing and the optimizer
# ---------------------------------------------------------------------------------------------


def apply_checkpointing(model: nn.Module, candidate: Candidate) -> None:
    """Wrap every (or every k-th) block of ``candidate.checkpoint_classes`` with non-reentrant
    activation checkpointing, in place; under ``selective``, each with the op-level policy of
    :func:`selective_policy` (``context_fn``), the same for FSDP1 and FSDP2."""
    if candidate.checkpointing is Checkpointing.NONE:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    classes = tuple(wrap_classes_of(model, candidate.checkpoint_classes))
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    chosen = {id(m) for i, m in enumerate(blocks) if candidate.checkpoints(i)}
    wrapper: Callable[[nn.Module], nn.Module] = checkpoint_wrapper
    if candidate.checkpointing is Checkpointing.SELECTIVE:
        wrapper = partial(checkpoint_wrapper, context_fn=selective_context)
    _without_kv_cache(model)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in chosen
    )


def _without_kv_cache(model: nn.Module) -> None:
    """Turn off a Hugging Face model's key/value cache (``config.use_cache``) under activation
    checkpointing, as its own ``gradient_checkpointing_enable`` does: in training the cache only
    keeps every layer's keys and values alive beside the checkpointed blocks (which the estimates
    count without it: +18% simulated on a 4-layer Llama at 512 tokens, fp32), and a forward that
    appends to it recomputes other operations than it ran (a longer key to slice), which
    selective checkpointing's replay refuses ("invocation ... not found in storage", torch 2.13)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False  # type: ignore[union-attr]


def _aten_ops(*names: str) -> frozenset[Any]:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


# What selective checkpointing keeps, after torchtitan (models/llama3/infra/parallelize.py,
# mode "selective", option "op"): matrix products, fused attention, float8's matmul and amax,
# and the tensor-parallel reduce-scatter. The CPU flash kernel is the CPU's fused attention
# (trials on gloo run it). ``addmm`` is a Linear with a bias (2-d, or 3-d contiguous input:
# aten.linear folds it into one addmm), the same product: counted as a matmul, unlike
# torchtitan's list (its models have no biases, so it never meets one).
SELECTIVE_MATMULS = _aten_ops("mm", "addmm")
SELECTIVE_SAVED = SELECTIVE_MATMULS | _aten_ops(
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_mm",
    "max",
)
if hasattr(torch.ops, "_c10d_functional"):
    SELECTIVE_SAVED |= {torch.ops._c10d_functional.reduce_scatter_tensor.default}


def selective_policy() -> Callable[..., Any]:
    """A fresh op-level policy for one checkpointed forward (and its recompute): save the
    outputs of :data:`SELECTIVE_SAVED`, except every second matrix product of the forward,
    recompute the rest (torchtitan's "save only every other mm"). Its counters start at zero:
    one policy per call of a checkpointed block, as ``context_fn`` makes it.

    >>> import torch
    >>> from torch.utils.checkpoint import SelectiveCheckpointContext
    >>> policy, ctx = selective_policy(), SelectiveCheckpointContext(is_recompute=False)
    >>> mm, relu = torch.ops.aten.mm.default, torch.ops.aten.relu.default
    >>> [policy(ctx, op).name for op in (mm, relu, mm, mm)]
    ['MUST_SAVE', 'PREFER_RECOMPUTE', 'PREFER_RECOMPUTE', 'MUST_SAVE']
    """
    from torch.utils.checkpoint import CheckpointPolicy

    matmuls = {"forward": 0, "recompute": 0}  # the recompute counts again, to match

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in SELECTIVE_MATMULS:
            matmuls[mode] += 1
            if matmuls[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func in SELECTIVE_SAVED:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context() -> Any:
    """``context_fn`` of a selectively checkpointed block: the forward and recompute contexts of
    a fresh :func:`selective_policy`."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_policy())


# ---------------------------------------------------------------------------------------------
# float8 (torchao)
# ---------------------------------------------------------------------------------------------


def float8_linears(model: nn.Module, candidate: Candidate) -> list[nn.Module]:
    """The ``nn.Linear`` layers float8 converts: those inside the wrap units' blocks (the whole
    model when it is one unit), with both dimensions multiples of 16 (``torch._scaled_mm``'s
    rule) and a weight of their own. The head and the embeddings stay bf16, as torchtitan's
    default filter (``filter_fqns=["output"]``) leaves them; a tied weight would be cast twice."""
    classes = (
        tuple(wrap_classes_of(model, candidate.wrap_classes)) if candidate.wrap_classes else ()
    )
    inside = (
        [m for block in model.modules() if isinstance(block, classes) for m in block.modules()]
        if classes
        else list(model.modules())
    )
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [
        m
        for m in dict.fromkeys(inside)
        if type(m) is nn.Linear
        and m.in_features % 16 == 0
        and m.out_features % 16 == 0
        and owners.get(id(m.weight), 0) == 1
    ]


def apply_float8(model: nn.Module, candidate: Candidate) -> None:
    """Swap :func:`float8_linears` for torchao's ``Float8Linear``, with FSDP2's float8
    all-gather (each rank casts its shard to fp8 before the all-gather: half the bytes of bf16),
    in place. Needs torchao (``pip install 'autoshard[float8]'``)."""
    if not candidate.float8:
        return
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise MissingDependencyError("torchao", "float8 training", extra="float8") from None
    chosen = {id(m) for m in float8_linears(model, candidate)}
    convert_to_float8_training(
        model,
        config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
        module_filter_fn=lambda module, _fqn: id(module) in chosen,
    )


def register_float8_scales(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After every ``optimizer.step()``, torchao's ``precompute_float8_dynamic_scale_for_fsdp``:
    the scales of all float8 weights in one all-reduce, instead of one per weight at the next
    all-gather (torchtitan's ``--float8.precompute_float8_dynamic_scale_for_fsdp``)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))


def make_optimizer(
    params: Iterable[nn.Parameter], candidate: Candidate, *, lr: float = 1e-4
) -> torch.optim.Optimizer:
    """The candidate's optimizer over ``params``: its row of
    :data:`~autoshard.config.OPTIMIZER_TRAITS`'s class with its arguments and the candidate's
    foreach / fused / for-loop choice."""
    row = OPTIMIZER_TRAITS[candidate.optimizer]
    module, _, name = row.class_path.rpartition(".")
    optimizer_class = getattr(importlib.import_module(module), name)
    return optimizer_class(params, lr=lr, **row.arguments(candidate.optimizer_impl))
