"""Round tick values for the report's charts (:mod:`autoshard.ui.html`,
:mod:`autoshard.ui.timeline`)."""

from __future__ import annotations

import math


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to about ``top``: steps of 1, 2 or 5 times a power of ten.

    >>> nice_ticks(97.0)
    [0, 20, 40, 60, 80]
    """
    if top <= 0:
        return [0.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(top / step) + 1)]


def byte_ticks(top: float) -> list[float]:
    """Tick values in bytes at round numbers of the unit format_bytes will print them in."""
    unit = next((u for u in (2**40, 2**30, 2**20, 2**10) if top >= u), 1)
    return [v * unit for v in nice_ticks(top / unit)]
