"""Module statistics of a model and the FSDP wrap / checkpointing policies they suggest.

Everything here works on the meta device: parameters are counted from shapes, never touched.
The block-finding rule, in order:

1. Hugging Face models name their block classes in ``_no_split_modules``; use those.
2. Otherwise take the repeated (2+ instances) composite class with the largest instances that
   still carries a real share of the parameters, then descend while a repeated composite class
   nested inside it has at least twice as many instances and carries most of its parameters
   (so ``T5Stack`` x2 gives way to ``T5Block`` x24, but ``Block`` does not give way to
   ``Linear``). Other repeated composite classes beside the chosen ones with a real share join
   them (the guide's ``{TransformerEncoderLayer, TransformerDecoderLayer}``).
3. With no repeated block the proposal is a size-based policy, or no wrapping for small models.
"""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import NamedTuple

from torch import nn

from autoshard.results import ClassStat, ModelProfile, ModuleStat, TiedGroup
from autoshard.target.resolve import BuiltModel, TargetSpec, build_target

# The seed guide: "avoid splitting small layers that have a few thousand parameters because
# communication overhead would dominate". A unit smaller than this is flagged.
SMALL_UNIT_PARAMS = 100_000
# A repeated class must carry at least this share of all parameters to be called a block (low,
# because in small token models the embedding and head dominate: the guide's demo Transformer
# keeps 7% of its parameters in its encoder and decoder layers).
MIN_BLOCK_SHARE = 0.02
# Descend from a chosen block to a finer repeated class only when the finer one covers nearly
# all of it (T5Stack -> T5Block), not when it is one part of it (DecoderLayer -> attention).
DESCEND_COVERAGE = 0.9
# A sibling block class joins the chosen one when its instances are at least this large
# relative to the chosen instances (encoder layers beside decoder layers).
SIBLING_SIZE = 0.25
# A root unit holding more than this share (and more than one block) is reported.
LARGE_ROOT_SHARE = 0.15
# Containers group modules but are never FSDP units of their own.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)
# Below this, a model with no repeated block is one FSDP unit; above, it is wrapped by size.
SIZE_WRAP_MIN_TOTAL = 10_000_000
MODULE_ROWS = 2000  # rows of the module tree (two levels) kept in the profile


def class_path(cls: type) -> str:
    """``module.QualName`` of a class, the form FSDP policies and YAML class paths use."""
    return f"{cls.__module__}.{cls.__qualname__}"


def analyze_target(target: TargetSpec) -> tuple[ModelProfile, BuiltModel]:
    """Build ``target`` on the meta device and analyse it.

    >>> from autoshard import TargetSpec, analyze_target
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "70b"}))
    >>> f"{profile.total_params:,}", built.model.lm_head.weight.is_meta  # no memory used
    ('68,976,648,192', True)
    """
    start = time.perf_counter()
    built = build_target(target)
    profile = analyze_model(
        built.model, target=str(target), built_on=built.built_on, extra_warnings=built.warnings
    )
    return profile.model_copy(update={"seconds": time.perf_counter() - start}), built


def analyze_model(
    model: nn.Module,
    *,
    target: str = "",
    built_on: str = "meta",
    extra_warnings: Iterable[str] = (),
) -> ModelProfile:
    """Count parameters per module and class, find the blocks, propose policies.

    >>> from torch import nn
    >>> from autoshard import analyze_model
    >>> layers = [nn.TransformerEncoderLayer(64, 4, 128, batch_first=True) for _ in range(4)]
    >>> profile = analyze_model(nn.Sequential(*layers))
    >>> profile.wrap_policy
    ('torch.nn.modules.transformer.TransformerEncoderLayer',)
    >>> profile.wrap_reason[:56]
    'repeated blocks TransformerEncoderLayer x4 (33,472 param'
    """
    start = time.perf_counter()
    tied = _find_tied(model)
    params_of = _unique_params_per_module(model)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())

    classes = _class_stats(model, params_of, total)
    no_split = tuple(getattr(model, "_no_split_modules", None) or ())
    blocks, block_reason = _find_blocks(model, classes, params_of, total, no_split)
    block_set = set(blocks)
    block_modules = [m for m in model.modules() if class_path(type(m)) in block_set]
    in_blocks = _union_size(block_modules)
    block_params = max((params_of[id(m)][1] for m in block_modules), default=0)
    frozen = _frozen_split(model, block_modules)

    root_params = total - in_blocks if blocks else total
    policies = _policies(blocks, block_reason, total)
    wrap_policy, wrap_min, wrap_reason, ckpt_policy, ckpt_reason = policies
    largest_unit = max(block_params, root_params)
    warnings = list(extra_warnings)
    warnings += _unit_warnings(model, block_set, params_of, tied, block_params, root_params, total)

    vocab, hidden = _largest_embedding(model)
    context = find_context(model)
    return ModelProfile(
        target=target or type(model).__name__,
        model_class=class_path(type(model)),
        total_params=total,
        trainable_params=trainable,
        frozen_params=total - trainable,
        **_shape_split(model),
        root_frozen_params=frozen.root,
        block_frozen_params=frozen.block,
        frozen_blocks=frozen.blocks,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        param_dtype=_param_dtype(model),
        built_on="cpu" if built_on != "meta" else "meta",
        classes=tuple(classes),
        modules=tuple(_module_rows(model, params_of)),
        tied=tuple(tied),
        no_split_modules=no_split,
        block_classes=blocks,
        block_count=len(block_modules),
        block_params=block_params,
        wrap_policy=wrap_policy,
        wrap_min_params=wrap_min,
        wrap_reason=wrap_reason,
        checkpoint_policy=ckpt_policy,
        checkpoint_reason=ckpt_reason,
        root_unit_params=root_params,
        largest_unit_params=largest_unit,
        vocab_size=vocab,
        hidden_size=hidden,
        context_length=context[0] if context else None,
        context_source=context[1] if context else "",
        warnings=tuple(warnings),
        seconds=time.perf_counter() - start,
    )


def _shape_split(model: nn.Module) -> dict[str, int]:
    """The profile's ``vector_params`` (trainable elements in tensors of fewer than two
    dimensions) and ``matrix_factor_params`` (elements of a row and a column vector of each
    other trainable tensor: an (..., m, n) tensor's rows are its ...*m vector, its columns its
    ...*n one, as torch's Adafactor keeps them)."""
    vectors = factors = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.dim() < 2:
            vectors += p.numel()
        else:
            batch = p.shape[:-2].numel()
            factors += batch * (p.shape[-2] + p.shape[-1])
    return {"vector_params": vectors, "matrix_factor_params": factors}


def _param_dtype(model: nn.Module) -> str:
    """The dtype that holds the most parameters ("float32" for a model without any)."""
    dtypes = Counter({str(p.dtype).removeprefix("torch."): 0 for p in model.parameters()})
    for p in model.parameters():
        dtypes[str(p.dtype).removeprefix("torch.")] += p.numel()
    return dtypes.most_common(1)[0][0] if dtypes else "float32"


def _policies(
    blocks: tuple[str, ...], block_reason: str, total: int
) -> tuple[tuple[str, ...], int | None, str, tuple[str, ...], str]:
    """(wrap policy, wrap min_num_params, why, checkpointing policy, why): the repeated
    ``blocks`` both wrapped and checkpointed; without them, wrap by size or not at all."""
    if blocks:
        ckpt_reason = (
            "checkpoint the same blocks, as the guide recommends: each recomputes its own "
            "activations in backward; the estimator decides whether that memory is needed"
        )
        return blocks, None, block_reason, blocks, ckpt_reason
    ckpt_reason = "no repeated block to checkpoint; checkpointing the whole model saves little"
    if total >= SIZE_WRAP_MIN_TOTAL:
        wrap_min = max(SMALL_UNIT_PARAMS, total // 8)
        wrap_reason = (
            f"no repeated block: wrap by size (min_num_params={wrap_min:,}), so units are "
            "large enough that communication does not dominate"
        )
        return (), wrap_min, wrap_reason, (), ckpt_reason
    wrap_reason = f"no repeated block and only {total:,} parameters: one FSDP unit (no wrapping)"
    return (), None, wrap_reason, (), ckpt_reason


def _unit_warnings(
    model: nn.Module,
    block_set: set[str],
    params_of: dict[int, tuple[set[int], int]],
    tied: list[TiedGroup],
    block_params: int,
    root_params: int,
    total: int,
) -> list[str]:
    """What the proposed units get wrong: blocks too small to be worth their collectives, a
    root that keeps more than a block (or LARGE_ROOT_SHARE of the model), tied weights."""
    warnings = []
    if block_set and block_params < SMALL_UNIT_PARAMS:
        warnings.append(
            f"wrapped units hold only {block_params:,} parameters each (< {SMALL_UNIT_PARAMS:,}): "
            "communication overhead will dominate; wrap a larger enclosing class"
        )
    if block_set and root_params > max(block_params, LARGE_ROOT_SHARE * total):
        owners = _root_owners(model, block_set, params_of)
        warnings.append(
            f"the root unit keeps {root_params:,} parameters ({root_params / total:.0%}) outside "
            f"the wrapped blocks ({owners}); they are gathered whole for every step"
            + (" and tied weights must stay together" if tied else "")
        )
    for group in tied:
        warnings.append(
            f"tied parameters {', '.join(group.names)} ({group.numel:,}) are one tensor: "
            "they stay in one FSDP unit"
        )
    return warnings


# Names of a learned positional table (GPT-2's wpe, BERT's position_embeddings, pos_emb...).
_POSITION_TABLE = re.compile(r"(^|[._])(wpe|pos|position|positional)(_?emb\w*|_?embed\w*)?$")
# Buffers of a precomputed rotary (or sinusoidal) table: their longest axis but the last (the
# features) is positions: (T, D/2) freqs_cis, (1, 1, T, D) cos_cached, (T, 1, D) pe.
_POSITION_CACHE = re.compile(r"(cos|sin)_cached$|freqs_cis$|(^|[._])(pe|rope_cache)$")
# Where a context length is written on a model or its config (Hugging Face, nanoGPT, ours).
_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "max_seq_len", "block_size")


def find_context(model: nn.Module) -> tuple[int, str] | None:
    """The longest sequence ``model`` takes, and what sets it: a learned positional table
    (past it, the lookup is an ``IndexError``), a precomputed rotary or sinusoidal cache, or the
    context written on the model or its config (``max_position_embeddings``, ``n_positions``);
    the smallest of those found. Shapes only: works on the meta device.

    >>> from autoshard import TargetSpec, analyze_target
    >>> profile, _ = analyze_target(TargetSpec(spec="examples/gpt.py:build",
    ...                                        kwargs={"size": "tiny"}))
    >>> profile.context_length, profile.context_source
    (256, 'positional table pos_emb (Embedding(256, 128))')
    """
    inner = getattr(model, "module", model)  # LightningStep
    found: list[tuple[int, str]] = []
    for name, module in inner.named_modules():
        if isinstance(module, nn.Embedding) and _POSITION_TABLE.search(name):
            found.append((module.num_embeddings, f"positional table {name} ({module})"))
    for name, buffer in inner.named_buffers():
        if _POSITION_CACHE.search(name) and buffer.dim() >= 2:
            positions = max(int(n) for n in buffer.shape[:-1])
            found.append((positions, f"position cache {name} {tuple(buffer.shape)}"))
    for where, holder in (("", inner), ("config.", getattr(inner, "config", None))):
        for attr in _CONTEXT_ATTRS:
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append((value, f"{where}{attr}"))
                break
    return min(found, key=lambda item: item[0]) if found else None


class _Frozen(NamedTuple):
    root: int  # frozen parameters outside the blocks
    block: int  # frozen parameters of the largest block that trains
    blocks: int  # blocks with no trainable parameter


def _frozen_split(model: nn.Module, block_modules: list[nn.Module]) -> _Frozen:
    """Where the frozen parameters (``requires_grad=False``) are: what FSDP1's flat gradients
    and FSDP2's per-parameter gradients depend on."""
    in_blocks: set[int] = set()
    largest: tuple[int, int] = (-1, 0)  # (params, frozen) of the largest training block
    frozen_blocks = 0
    for block in block_modules:
        params = list(block.parameters())
        in_blocks.update(id(p) for p in params)
        frozen = sum(p.numel() for p in params if not p.requires_grad)
        size = sum(p.numel() for p in params)
        if frozen == size:
            frozen_blocks += 1
        elif size > largest[0]:
            largest = (size, frozen)
    root = sum(
        p.numel() for p in model.parameters() if not p.requires_grad and id(p) not in in_blocks
    )
    return _Frozen(root=root, block=largest[1], blocks=frozen_blocks)


def _find_tied(model: nn.Module) -> list[TiedGroup]:
    names: dict[int, list[str]] = defaultdict(list)
    numel: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)].append(name)
        numel[id(p)] = p.numel()
    return [TiedGroup(names=tuple(n), numel=numel[k]) for k, n in names.items() if len(n) > 1]


def _unique_params_per_module(model: nn.Module) -> dict[int, tuple[set[int], int]]:
    """For each module (by id): the ids of the parameters under it and their unique count.

    Computed bottom-up once, so a 70B model with thousands of modules takes milliseconds.
    """
    out: dict[int, tuple[set[int], int]] = {}
    sizes: dict[int, int] = {}

    def visit(module: nn.Module) -> set[int]:
        key = id(module)
        if key in out:
            return out[key][0]
        ids: set[int] = set()
        for p in module.parameters(recurse=False):
            ids.add(id(p))
            sizes[id(p)] = p.numel()
        for child in module.children():
            ids |= visit(child)
        out[key] = (ids, sum(sizes[i] for i in ids))
        return ids

    visit(model)
    return out


def _union_size(modules: Iterable[nn.Module], *, frozen_only: bool = False) -> int:
    seen: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            if not (frozen_only and p.requires_grad):
                seen[id(p)] = p.numel()
    return sum(seen.values())


def _class_stats(
    model: nn.Module, params_of: dict[int, tuple[set[int], int]], total: int
) -> list[ClassStat]:
    instances: dict[type, list[nn.Module]] = defaultdict(list)
    for m in model.modules():
        instances[type(m)].append(m)
    stats = []
    for cls, mods in instances.items():
        union = _union_size(mods)
        if union == 0:
            continue
        sizes = [params_of[id(m)][1] for m in mods]
        stats.append(
            ClassStat(
                class_path=class_path(cls),
                name=cls.__name__,
                count=len(mods),
                params_each=max(sizes),
                params_smallest=min(sizes) if min(sizes) != max(sizes) else None,
                params_total=union,
                frozen_total=_union_size(mods, frozen_only=True),
                share=union / total if total else 0.0,
            )
        )
    stats.sort(key=lambda s: (-s.params_total, s.count))
    return stats


def _is_composite(cls_stat: ClassStat, model: nn.Module) -> bool:
    for m in model.modules():
        if class_path(type(m)) == cls_stat.class_path:
            return any(True for _ in m.children())
    return False


def _find_blocks(
    model: nn.Module,
    classes: list[ClassStat],
    params_of: dict[int, tuple[set[int], int]],
    total: int,
    no_split: tuple[str, ...],
) -> tuple[tuple[str, ...], str]:
    by_name = {c.name: c for c in classes}
    if no_split:
        found = [by_name[n] for n in no_split if n in by_name]
        if found:
            names = ", ".join(f"{c.name} x{c.count}" for c in found)
            share = _union_size(
                m for m in model.modules() if type(m).__name__ in {c.name for c in found}
            )
            return tuple(c.class_path for c in found), (
                f"the model's _no_split_modules names its blocks ({names}); they hold "
                f"{share / total:.0%} of the parameters"
            )

    container_paths = {class_path(c) for c in _CONTAINERS}
    repeated = [
        c
        for c in classes
        if c.count >= 2
        and c.class_path not in container_paths
        and c.class_path != class_path(type(model))
        and _is_composite(c, model)
    ]
    # A model built only of repeated leaves (a stack of equal Linear layers) has them as its
    # blocks; leaves of different shapes (an input and an output projection) are no block.
    if not repeated:
        repeated = [
            c
            for c in classes
            if c.count >= 2
            and c.class_path not in container_paths
            and c.share >= 0.5
            and c.params_total == c.count * c.params_each
        ]
    eligible = [c for c in repeated if c.share >= MIN_BLOCK_SHARE]
    if not eligible:
        return (), ""
    chosen = max(eligible, key=lambda c: (c.params_each, c.share))
    # Descend to a finer repeated class nested in the chosen one when it carries most of it.
    while True:
        finer = [
            c
            for c in eligible
            if c.count >= 2 * chosen.count
            and _params_inside(model, c.class_path, chosen.class_path)
            >= DESCEND_COVERAGE * chosen.params_total
        ]
        if not finer:
            break
        chosen = max(finer, key=lambda c: (c.params_each, c.share))
    picked = [chosen]
    for c in eligible:
        if (
            c is chosen
            or c.params_each < SIBLING_SIZE * chosen.params_each
            or any(
                _nested_in(model, c.class_path, p.class_path)
                or _nested_in(model, p.class_path, c.class_path)
                for p in picked
            )
        ):
            continue
        picked.append(c)
    covered = _union_size(
        m for m in model.modules() if class_path(type(m)) in {p.class_path for p in picked}
    )
    names = ", ".join(f"{c.name} x{c.count} ({c.params_each:,} params each)" for c in picked)
    return tuple(p.class_path for p in picked), (
        f"repeated blocks {names} hold {covered / total:.0%} of the parameters: one FSDP unit "
        "per block gathers one block at a time"
    )


def _params_inside(model: nn.Module, inner: str, outer: str) -> int:
    """Unique parameters of the ``inner``-class instances that lie inside ``outer`` instances."""
    return _union_size(
        sub
        for m in model.modules()
        if class_path(type(m)) == outer
        for sub in m.modules()
        if sub is not m and class_path(type(sub)) == inner
    )


def _nested_in(model: nn.Module, inner: str, outer: str) -> bool:
    """Whether some instance of class ``inner`` lies inside an instance of class ``outer``."""
    return any(
        class_path(type(sub)) == inner
        for m in model.modules()
        if class_path(type(m)) == outer
        for sub in m.modules()
        if sub is not m
    )


def _root_owners(
    model: nn.Module, block_set: set[str], params_of: dict[int, tuple[set[int], int]]
) -> str:
    """Name the largest direct children that are not blocks (what stays in the root unit)."""
    rows: list[tuple[int, str]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if class_path(type(child)) in block_set:
                continue
            if isinstance(child, _CONTAINERS) or any(
                class_path(type(m)) in block_set for m in child.modules()
            ):
                visit(full + ".", child)
                continue
            if params_of[id(child)][1]:
                rows.append((params_of[id(child)][1], full))
        own = sum(p.numel() for p in module.parameters(recurse=False))
        if own:
            rows.append((own, prefix.rstrip(".") or "<root>"))

    visit("", model)
    rows.sort(reverse=True)
    return ", ".join(f"{n} {c:,}" for c, n in rows[:4])


def _module_rows(model: nn.Module, params_of: dict[int, tuple[set[int], int]]) -> list[ModuleStat]:
    rows: list[ModuleStat] = []
    for name, module in model.named_modules():
        depth = 0 if not name else name.count(".") + 1
        if depth > 2:
            continue
        rows.append(
            ModuleStat(
                name=name,
                class_path=class_path(type(module)),
                depth=depth,
                params=params_of[id(module)][1],
                own_params=sum(p.numel() for p in module.parameters(recurse=False)),
            )
        )
        if len(rows) >= MODULE_ROWS:
            break
    return rows


def _largest_embedding(model: nn.Module) -> tuple[int | None, int | None]:
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return None, None
    biggest = max(embeddings, key=lambda m: m.num_embeddings * m.embedding_dim)
    return biggest.num_embeddings, biggest.embedding_dim
