"""Tables that fit the terminal: no header, value or reason cut mid-word at any width.

rich shrinks a table that is too wide by cutting cells with an ellipsis ("configurati…") or
folding words; here each column gets at least its longest word, the columns the reader can best
spare are dropped until that fits, and the rest wrap at spaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text


@dataclass(frozen=True)
class Column:
    """A column of a fitted table; ``keep``: the higher, the longer it stays when the terminal
    is narrow (those with the highest never go)."""

    name: str
    justify: Literal["left", "right", "center"] = "left"
    keep: int = 0
    wrap: bool = False  # text (a label, a reason) may wrap at spaces; a value never splits


def _plain(cell: str) -> str:
    return Text.from_markup(cell).plain


def _longest_word(text: str) -> int:
    return max((cell_len(w) for w in text.split()), default=0)


def _widest_line(text: str) -> int:
    return max((cell_len(line) for line in text.splitlines()), default=0)


def fitted_table(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int, **table: Any
) -> Table:
    """A rich ``Table`` (default box, one space of padding) of ``rows`` no wider than ``width``:
    every column at least as wide as its longest word, columns with the lowest ``keep``
    dropped (and named in the caption) while even that is too wide, the widest ones wrapped at
    spaces to fit. Cells are rich markup."""
    plain = [[_plain(c) for c in row] for row in rows]
    natural = [
        max([cell_len(col.name)] + [_widest_line(r[i]) for r in plain])
        for i, col in enumerate(columns)
    ]
    shortest = [
        max([_longest_word(col.name)] + [_longest_word(r[i]) if col.wrap else
             _widest_line(r[i]) for r in plain])
        for i, col in enumerate(columns)
    ]  # fmt: skip
    # A column with nothing in it says nothing (e.g. host memory when nothing offloads).
    kept = [i for i in range(len(columns)) if any(r[i].strip() for r in plain) or not rows]

    def room(indices: list[int]) -> int:  # inside the borders and the padding of each column
        return width - (3 * len(indices) + 1)

    order = sorted(kept, key=lambda i: columns[i].keep)
    dropped: list[int] = []
    while len(kept) > 1 and sum(shortest[i] for i in kept) > room(kept):
        victim = next(i for i in order if i in kept and columns[i].keep < max_keep(columns))
        kept.remove(victim)
        dropped.append(victim)
    widths = {i: natural[i] for i in kept}
    excess = sum(widths.values()) - room(kept)
    while excess > 0:
        # Shrink the column with the most to spare above its longest word, one cell at a time.
        i = max(kept, key=lambda k: (widths[k] - shortest[k], widths[k]))
        if widths[i] <= shortest[i]:
            break
        widths[i] -= 1
        excess -= 1
    out = Table(**table)
    for i in kept:
        c = columns[i]
        out.add_column(c.name, justify=c.justify, width=widths[i], overflow="fold")
    for row in rows:
        out.add_row(*(row[i] for i in kept))
    if dropped:
        names = ", ".join(columns[i].name for i in sorted(dropped) if columns[i].name)
        note = f"not shown at this width: {names}" if names else ""
        if note:
            caption = str(out.caption or "")
            out.caption = f"{caption}; {note}" if caption else note
    return out


def max_keep(columns: Sequence[Column]) -> int:
    """The ``keep`` of the columns that are never dropped."""
    return max(c.keep for c in columns)
