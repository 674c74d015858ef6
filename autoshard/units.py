"""Human byte sizes: parse ``80GiB`` / ``40GB`` / ``24000MiB`` and format bytes for people."""

from __future__ import annotations

import math
import re

from autoshard.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, *, flag: str = "size") -> int:
    """Return the number of bytes in a human size such as ``80GiB``, ``40GB`` or ``24000MiB``.

    An int is bytes; a string needs a unit (``"80"`` is refused: 80 what?). Decimal units (GB)
    are powers of 1000, binary units (GiB) of 1024,
    as GPU vendors and ``nvidia-smi`` use them respectively.
    """
    if isinstance(text, bool):
        raise ConfigError(f"{flag}: expected a size such as 80GiB, got {text!r}")
    if isinstance(text, int | float):
        if not math.isfinite(text):
            raise ConfigError(f"{flag}: give a finite size, got {text}")
        if text <= 0:
            raise ConfigError(f"{flag}: size must be positive, got {text}")
        return int(text)
    match = _SIZE.match(text)
    if match and not match.group(2):
        # On the command line a bare number is a mistake far more often than bytes (80 meant
        # 80 GiB): only Python callers pass bytes, as ints.
        raise ConfigError(f"{flag} {text.strip()}: give a unit, e.g. {text.strip()}GiB")
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"{flag}: cannot read {text!r} as a size; write it like 80GiB, 40GB or 24000MiB"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ConfigError(f"{flag}: size must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    """Format bytes in binary units with three significant digits (``6.71 GiB``)."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if unit == "B" and n < 1024:
            return f"{sign}{n:.0f} B"
        # 999.5-1023.9 would print as "1e+03" with 3 significant digits: write them whole
        if n < 999.5:
            return f"{sign}{n:.3g} {unit}"
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:,.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_count(n: float) -> str:
    """Format a parameter count for people (``6.74B``, ``124M``, ``8.2K``)."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def format_share(x: float) -> str:
    """A fraction as a percentage that does not round a small model's MFU down to "0%".

    >>> format_share(0.446), format_share(0.0042), format_share(0.00004)
    ('45%', '0.4%', '<0.1%')
    """
    if x >= 0.01 or x <= 0:
        return f"{x:.0%}"
    return f"{x:.1%}" if x >= 0.001 else "<0.1%"
