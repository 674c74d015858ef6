"""The pixel width of a label in the report's charts (ui/textwidth.py): at least what the common
fonts take, so that no label runs into its neighbour."""

from __future__ import annotations

import pytest

from autoshard.ui.textwidth import BOLD, text_width


def test_width_scales_with_the_size_and_adds_up_over_the_text() -> None:
    assert text_width("") == 0
    one = text_width("fsdp1 FULL_SHARD", 12)
    assert round(one) == 115
    assert text_width("fsdp1 FULL_SHARD", 24) == pytest.approx(2 * one)
    assert text_width("ab") == pytest.approx(text_width("a") + text_width("b"))
    assert text_width("x", bold=True) == pytest.approx(BOLD * text_width("x"))


def test_wide_letters_are_wider_than_narrow_ones_and_unknown_ones_a_full_em() -> None:
    assert text_width("i") < text_width("m") < text_width("W") <= text_width("\u4e2d")
    assert text_width("\u4e2d", 12) == pytest.approx(12.0)  # not in the table: an em, at most
