"""Round tick values for the report's charts (ui/ticks.py)."""

from __future__ import annotations

import itertools

import pytest

from autoshard.ui.ticks import byte_ticks, nice_ticks


@pytest.mark.parametrize(
    ("top", "ticks"),
    [
        (97.0, [0, 20, 40, 60, 80]),
        (100.0, [0, 20, 40, 60, 80, 100]),
        (7.0, [0, 2, 4, 6]),
        (23.0, [0, 5, 10, 15, 20]),
        (0.9, [0, 0.2, 0.4, 0.6000000000000001, 0.8]),
        (0.0, [0.0]),
        (-3.0, [0.0]),
    ],
)
def test_ticks_step_by_one_two_or_five_times_a_power_of_ten(top: float, ticks: list) -> None:
    assert nice_ticks(top) == pytest.approx(ticks)


@pytest.mark.parametrize("top", [3.0, 97.0, 1234.5, 0.07, 5e9])
def test_ticks_never_pass_the_top_and_stay_few(top: float) -> None:
    ticks = nice_ticks(top)
    assert ticks[0] == 0 and ticks[-1] <= top
    assert 3 <= len(ticks) <= 11
    steps = {round(b - a, 12) for a, b in itertools.pairwise(ticks)}
    assert len(steps) == 1


def test_byte_ticks_are_round_in_the_unit_the_axis_prints() -> None:
    assert byte_ticks(10 * 2**30) == [0, 2 * 2**30, 4 * 2**30, 6 * 2**30, 8 * 2**30, 10 * 2**30]
    assert byte_ticks(3 * 2**20) == [0, 2**20, 2 * 2**20, 3 * 2**20]
    assert byte_ticks(500) == [0, 100, 200, 300, 400, 500]
