"""Error bars (autoshard.predict.intervals): every prediction carries its class's held-out
band; a class without enough rows falls back to a coarser one; overlapping intervals are a
tie; a calibrated class's band is its own trials'."""

from __future__ import annotations

import pytest

from autoshard.predict import intervals
from autoshard.predict.intervals import (
    HELD_OUT_BANDS,
    MIN_ROWS,
    Band,
    band_for,
    calibrated_band,
    model_class,
    overlap,
    with_interval,
)
from autoshard.results import SpeedEstimate


def speed(step: float, interval: tuple[float, float] | None = None) -> SpeedEstimate:
    return SpeedEstimate(step_time_s=step, samples_per_s=1 / step, interval_s=interval)


def test_the_class_is_generation_precision_and_size() -> None:
    assert model_class("hopper", "bf16-mixed", 1.1e9) == ("hopper", "16-bit", "<=2B")
    assert model_class("ampere", "32-true", 7e9) == ("ampere", "fp32", "2-10B")
    assert model_class("", "16-mixed", 7e10) == ("*", "16-bit", ">10B")


def test_a_prediction_carries_its_class_band(monkeypatch: pytest.MonkeyPatch) -> None:
    bands = {
        ("*", "*", "*"): Band(0.5, 2.0, 0.3, 40),
        ("hopper", "*", "*"): Band(0.7, 1.4, 0.2, 12),
        ("hopper", "16-bit", "*"): Band(0.8, 1.3, 0.1, 9),
        ("hopper", "16-bit", "<=2B"): Band(0.9, 1.2, 0.1, MIN_ROWS),
        ("hopper", "16-bit", "2-10B"): Band(0.95, 1.05, 0.02, MIN_ROWS - 1),
    }
    monkeypatch.setattr(intervals, "HELD_OUT_BANDS", bands)
    small = with_interval(speed(2.0), ("hopper", "16-bit", "<=2B"))
    assert small.interval_s == pytest.approx((1.8, 2.4))
    assert "hopper 16-bit <=2B" in small.interval_class and "3 rows" in small.interval_class
    # too few rows: the generation's and precision's band, never a narrower one
    medium = with_interval(speed(2.0), ("hopper", "16-bit", "2-10B"))
    assert medium.interval_s == pytest.approx((1.6, 2.6))
    # a generation with no held-out row: every row's band
    unknown = with_interval(speed(1.0), ("blackwell", "16-bit", "<=2B"))
    assert unknown.interval_s == pytest.approx((0.5, 2.0))
    assert band_for(("blackwell", "fp32", ">10B"))[1].startswith("all classes")


def test_the_committed_bands_are_well_formed() -> None:
    assert ("*", "*", "*") in HELD_OUT_BANDS
    for key, band in HELD_OUT_BANDS.items():
        assert len(key) == 3 and band.rows >= 1
        assert 0 < band.low <= band.high and band.median_error >= 0
        # a coarser class holds every row of its finer ones
        coarser = (key[0], key[1], "*") if key[2] != "*" else (key[0], "*", "*")
        if key != ("*", "*", "*") and coarser in HELD_OUT_BANDS:
            wider = HELD_OUT_BANDS[coarser]
            assert wider.rows >= band.rows and wider.low <= band.low and wider.high >= band.high


def test_overlapping_intervals_are_a_tie_apart_ones_are_not() -> None:
    fast = speed(1.0, (0.8, 1.3))
    assert overlap(fast, speed(1.5, (1.2, 1.9)))
    assert overlap(speed(1.5, (1.2, 1.9)), fast)  # symmetric
    assert not overlap(fast, speed(1.6, (1.4, 2.0)))
    # without intervals only equal steps tie
    assert overlap(speed(1.0), speed(1.0)) and not overlap(speed(1.0), speed(1.01))


def test_a_calibrated_band_is_its_trials_residuals_widened_by_their_spread() -> None:
    band = calibrated_band([0.95, 1.1], [0.02, 0.05])
    assert band.low == pytest.approx(0.95 * 0.98) and band.high == pytest.approx(1.1 * 1.05)
    assert band.rows == 2
    # it always holds the prediction itself
    assert calibrated_band([1.2], [0.0]).low == 1.0
