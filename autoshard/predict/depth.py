"""Depth: a deep model is simulated with a few blocks in each stack and extrapolated.

The peak is affine in the number of blocks of each stack (design notes, "Memory"), so the model
is simulated with :data:`EXTRAPOLATE_FROM` blocks in each deep stack (an encoder-decoder's two
alike), then once per stack with one block more, and each line is extended to the stack's real
depth (:func:`extrapolate_depth`). torch's memory tracker walks every tracked module at every
operation, so a whole 64-block model took longer than 15 minutes where three simulations of 8 to
9 blocks take seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from autoshard.sharding import wrap_classes_of

# Stacks deeper than EXTRAPOLATE_ABOVE blocks are simulated with EXTRAPOLATE_FROM blocks and one
# more, and extrapolated (the peak is affine in depth from 4 blocks up).
EXTRAPOLATE_FROM = 4
EXTRAPOLATE_ABOVE = 8
# Where the shallow model peaks at another moment than one block deeper, it is simulated again
# one block deeper, at most this many times (each time costs as much as the first).
DEEPEN_AT_MOST = 2

Phases = dict[str, dict[str, int]]  # phase -> tracker kind -> bytes at the phase's peak


def block_lists(model: nn.Module, block_classes: tuple[str, ...]) -> dict[str, int]:
    """The ModuleLists (and Sequentials) that hold the model's repeated blocks, by name, with
    their lengths: an encoder-decoder's two stacks, a decoder's one (not the model itself: it
    cannot be replaced in place). A list inside another's blocks (a stage's layers) is not
    counted apart: truncating the outer list truncates it."""
    classes = tuple(wrap_classes_of(model, block_classes)) if block_classes else ()
    if not classes:
        return {}
    found: dict[str, int] = {}
    for name, child in model.named_modules():
        if (
            not name
            or not isinstance(child, nn.ModuleList | nn.Sequential)
            or any(name.startswith(f"{outer}.") for outer in found)
        ):
            continue
        if any(isinstance(m, classes) for m in child):
            found[name] = len(child)
    return found


def truncate_blocks(model: nn.Module, depths: dict[str, int]) -> None:
    """Keep only the first ``depths[name]`` entries of each block list ``name``, in place."""
    for name, depth in depths.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        kept = list(getattr(parent, attribute))[:depth]
        sequential = type(getattr(parent, attribute)) is nn.Sequential
        setattr(parent, attribute, nn.Sequential(*kept) if sequential else nn.ModuleList(kept))


def deep_lists(lists: dict[str, int]) -> dict[str, int]:
    """The block lists deep enough to extrapolate."""
    return {name: n for name, n in lists.items() if n > EXTRAPOLATE_ABOVE}


def extrapolate_depth(
    run: Callable[[dict[str, int]], Phases], deep: dict[str, int]
) -> tuple[Phases, str]:
    """Each phase's peak at the real depths of the ``deep`` block lists, from ``run`` (a
    simulation at the depths it is given), and how it was found."""
    # Every deep list at k blocks, then each alone at k + 1: the peak is affine in the depth
    # of each (an encoder's blocks add their activations whatever the decoder's depth).
    k = EXTRAPOLATE_FROM
    while True:
        base = dict.fromkeys(deep, k)
        low = run(base)
        steps = {name: run({**base, name: k + 1}) for name in deep}
        last = k >= EXTRAPOLATE_FROM + DEEPEN_AT_MOST or k + 2 >= min(deep.values())
        if last or _same_moments(low, steps.values()):
            break
        # The shallow model peaked at another moment than the deeper ones (a large root
        # unit's gradients outweighing a few blocks' activations): its line would be too
        # flat. Start again one block deeper.
        k += 1
    # Each phase's peak is affine in depth, but at different rates: the optimizer step
    # grows by a block's parameters, gradients and states, forward and backward by less
    # on many ranks. Extrapolated on its own, each phase can overtake the other (a 7B
    # shape at 8 ranks with checkpointing peaks in backward at 4 and 5 blocks, in the
    # optimizer step at 32: one extrapolated peak was 5% low).
    phases = {
        phase: _extrapolate(low[phase], [(steps[name][phase], deep[name] - k) for name in deep])
        for phase in low.keys() & set.intersection(*(set(s) for s in steps.values()))
    }
    stacks = ", ".join(f"{k} and {k + 1} of {n} {name}" for name, n in deep.items())
    return phases, f"simulated {stacks}, extrapolated"


def _same_moments(low: Phases, deeper: Iterable[Phases]) -> bool:
    """Whether each phase peaked at the same moment with one block more: a block adds bytes
    and takes none away, so no kind falls by more than 1% of the phase's peak."""
    for phases in deeper:
        for phase, kinds in low.items():
            high = phases.get(phase, {})
            total = max(kinds.get("Total", 0), 1)
            if any(high.get(key, 0) < v - total // 100 for key, v in kinds.items()):
                return False
    return True


def _extrapolate(low: dict[str, int], steps: list[tuple[dict[str, int], int]]) -> dict[str, int]:
    """The per-kind bytes of a phase from ``low`` (every block list at its simulated depth) and,
    per list, ``(high, more)``: the phase with that list one block deeper, and how many blocks
    deeper the real list is."""
    keys = set(low).union(*(high for high, _ in steps))
    kinds = {
        key: max(
            0,
            low.get(key, 0)
            + sum(more * (high.get(key, 0) - low.get(key, 0)) for high, more in steps),
        )
        for key in keys
    }
    # The two depths may peak at different moments of the phase: the total extrapolates
    # exactly, the split by kind only roughly, so the kinds are scaled to add up to the total.
    parts = sum(v for key, v in kinds.items() if key != "Total")
    if parts:
        kinds = {
            key: v if key == "Total" else v * kinds["Total"] // parts for key, v in kinds.items()
        }
    return kinds
