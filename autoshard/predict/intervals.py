"""Error bars on predicted step times: each prediction carries the interval its class earned on
the held-out benchmark rows (``SpeedEstimate.interval_s``), and two predictions whose
intervals overlap are a tie for the model (:func:`overlap`).

A class is the GPU's generation, the precision (16-bit on tensor cores, fp32 on CUDA cores) and
the model's size (:func:`model_class`). Its band is the lowest and the highest measured /
predicted step time among the held-out rows of that class in
``benchmarks/step_time_published.py`` (the published held-out set and the held-out half of
autoshard's own GPU measurements, never a row the model was fitted on), with the median
absolute error beside it: how far a single prediction of the class may be from a measurement.
A class with fewer than :data:`MIN_ROWS` held-out rows takes its generation's and precision's
band, then its generation's, then every held-out row's (said in ``interval_class``).

Once trials calibrated a candidate's class, its interval is the calibration's own: the
measured / predicted range of the trials it was fitted on, widened by their spread
(:func:`calibrated_band`).

The table is the benchmark's output (``HELD_OUT_BANDS`` printed by
``python benchmarks/step_time_published.py``), copied here when the model changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autoshard.config import Precision
from autoshard.results import SpeedEstimate

MIN_ROWS = 3


@dataclass(frozen=True)
class Band:
    """Measured / predicted step time on a class's held-out rows: the lowest, the highest, the
    median absolute error (of tokens/s, the benchmark's error), and how many rows."""

    low: float
    high: float
    median_error: float
    rows: int


# (generation, precision, size) -> band; "*" for every value. Printed by
# benchmarks/step_time_published.py ("Held-out bands"), the model of this commit.
HELD_OUT_BANDS: dict[tuple[str, str, str], Band] = {
    ("*", "*", "*"): Band(0.496, 14.051, 0.164, 39),
    ("ampere", "*", "*"): Band(0.496, 14.051, 0.108, 17),
    ("ampere", "16-bit", "*"): Band(0.496, 4.643, 0.086, 13),
    ("ampere", "16-bit", "2-10B"): Band(0.914, 1.031, 0.048, 7),
    ("ampere", "16-bit", "<=2B"): Band(1.108, 4.643, 2.854, 5),
    ("ampere", "16-bit", ">10B"): Band(0.496, 0.496, 0.504, 1),
    ("ampere", "fp32", "*"): Band(0.857, 14.051, 0.129, 4),
    ("ampere", "fp32", "<=2B"): Band(0.857, 14.051, 0.129, 4),
    ("hopper", "*", "*"): Band(0.667, 1.322, 0.189, 22),
    ("hopper", "16-bit", "*"): Band(0.667, 1.322, 0.189, 20),
    ("hopper", "16-bit", "2-10B"): Band(0.667, 1.231, 0.200, 11),
    ("hopper", "16-bit", "<=2B"): Band(0.714, 1.322, 0.142, 8),
    ("hopper", "16-bit", ">10B"): Band(0.759, 0.759, 0.241, 1),
    ("hopper", "fp32", "*"): Band(0.741, 0.935, 0.162, 2),
    ("hopper", "fp32", "<=2B"): Band(0.741, 0.935, 0.162, 2),
}


def size_class(params: float) -> str:
    """The model-size classes of the bands (and of :mod:`autoshard.predict.ceilings`)."""
    return "<=2B" if params <= 2e9 else "2-10B" if params <= 1e10 else ">10B"


def precision_class(precision: Precision | str) -> str:
    return "fp32" if Precision(precision) is Precision.FP32 else "16-bit"


def model_class(generation: str, precision: Precision | str, params: float) -> tuple[str, ...]:
    """The class of a prediction: (GPU generation, precision, model size)."""
    return generation or "*", precision_class(precision), size_class(params)


def band_for(key: tuple[str, ...]) -> tuple[Band, str]:
    """The held-out band of a class, falling back to coarser ones (generation and precision,
    generation, all) where the class has fewer than :data:`MIN_ROWS` rows; and its name."""
    generation, precision, size = key
    for candidate in (
        (generation, precision, size),
        (generation, precision, "*"),
        (generation, "*", "*"),
        ("*", "*", "*"),
    ):
        band = HELD_OUT_BANDS.get(candidate)
        if band is not None and band.rows >= MIN_ROWS:
            name = " ".join(part for part in candidate if part != "*") or "all classes"
            return band, f"{name} (held-out, {band.rows} rows)"
    return HELD_OUT_BANDS[("*", "*", "*")], "all classes (held-out)"


def with_interval(speed: SpeedEstimate, key: tuple[str, ...]) -> SpeedEstimate:
    """``speed`` with the interval of its class's held-out band."""
    band, name = band_for(key)
    step = speed.step_time_s
    return speed.model_copy(
        update={"interval_s": (step * band.low, step * band.high), "interval_class": name}
    )


def calibrated_band(ratios: Sequence[float], spreads: Sequence[float]) -> Band:
    """The band of a calibrated class: its trials' measured / predicted (after the fit), each
    widened by its measurement's spread."""
    low = min(r * (1 - s) for r, s in zip(ratios, spreads, strict=True))
    high = max(r * (1 + s) for r, s in zip(ratios, spreads, strict=True))
    errors = sorted(abs(r - 1) for r in ratios)
    return Band(min(low, 1.0), max(high, 1.0), errors[len(errors) // 2], len(ratios))


def overlap(a: SpeedEstimate, b: SpeedEstimate) -> bool:
    """Whether the two predictions' intervals overlap: the model cannot tell which step is
    faster (a tie). Predictions without an interval overlap only when their step times are
    equal.

    >>> from autoshard.results import SpeedEstimate
    >>> fast = SpeedEstimate(step_time_s=1.0, samples_per_s=1, interval_s=(0.8, 1.3))
    >>> slow = SpeedEstimate(step_time_s=1.5, samples_per_s=1, interval_s=(1.2, 1.9))
    >>> overlap(fast, slow), overlap(fast, slow.model_copy(update={"interval_s": (1.4, 2)}))
    (True, False)
    """
    ia = a.interval_s or (a.step_time_s, a.step_time_s)
    ib = b.interval_s or (b.step_time_s, b.step_time_s)
    return ia[0] <= ib[1] and ib[0] <= ia[1]
