"""Tables that fit the terminal (ui/fit.py): at any width no word is cut, the columns the reader
can best spare go first (named in the caption), and a column with nothing in it says nothing."""

from __future__ import annotations

import io

from rich.console import Console

from autoshard.ui.fit import Column, fitted_table, max_keep

COLUMNS = [
    Column("configuration", keep=3, wrap=True),
    Column("step", justify="right", keep=3),
    Column("host memory", justify="right", keep=1),
    Column("reason", keep=2, wrap=True),
]
ROWS = [
    ["fsdp2 FULL_SHARD bf16-mixed", "0.84 s", "12.0 GiB", "fits with 20.1 GiB to spare"],
    ["fsdp1 NO_SHARD fp32", "1.90 s", "3.0 GiB", "does not fit: 95.2 GiB per GPU"],
]


def shown(width: int, rows: list[list[str]] = ROWS) -> tuple[str, list[str]]:
    out = io.StringIO()
    table = fitted_table(COLUMNS, rows, width)
    Console(file=out, width=width, color_system=None).print(table)
    return out.getvalue(), [c.header for c in table.columns]


def words_of(text: str) -> set[str]:
    # the words in the table's cells (not its caption); the box's lines are no words
    cells = " ".join(line for line in text.splitlines() if "│" in line or "┃" in line)
    return {w.strip("│┃") for w in cells.split() if any(ch.isalnum() for ch in w)}


def test_at_every_width_no_word_is_cut_and_no_line_is_wider() -> None:
    wide, _ = shown(300)
    for width in (120, 80, 60, 50, 40, 30):
        text, _ = shown(width)
        assert max(len(line) for line in text.splitlines()) <= width, width
        assert "…" not in text
        assert words_of(text) <= words_of(wide), width


def test_the_column_to_spare_goes_first_and_the_caption_names_it() -> None:
    _, headers = shown(300)
    assert headers == ["configuration", "step", "host memory", "reason"]
    text, headers = shown(45)
    assert headers == ["configuration", "step", "reason"]
    assert "not shown at this width: host memory" in text
    _, headers = shown(30)
    assert headers == ["configuration", "step"]  # the highest keep never goes
    assert max_keep(COLUMNS) == 3


def test_an_empty_column_is_left_out_without_a_word() -> None:
    rows = [[c, s, "", r] for c, s, _, r in ROWS]
    text, headers = shown(300, rows)
    assert "host memory" not in headers and "not shown" not in text
