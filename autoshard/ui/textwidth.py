"""How wide a line of text renders, for report.html's charts: they have no script to measure
their labels, so the room left of a bar or right of a plot is computed here, for the widest of
the common sans-serif fonts (DejaVu Sans, the Linux default, whose advance widths these are),
so that no browser clips a label."""

from __future__ import annotations

# DejaVu Sans advance widths in units of its 2048-unit em, per character; every other one is
# taken at a whole em (none is wider).
_EM = 2048
_WIDTHS = {
    " ": 651, "!": 821, '"': 942, "#": 1716, "$": 1303, "%": 1946, "&": 1597, "'": 563,
    "(": 799, ")": 799, "*": 1024, "+": 1716, ",": 651, "-": 739, ".": 651, "/": 690,
    ":": 690, ";": 690, "<": 1716, "=": 1716, ">": 1716, "?": 1087, "@": 2048, "[": 799,
    "\\": 690, "]": 799, "^": 1716, "_": 1024, "`": 1024, "{": 1303, "|": 690, "}": 1303,
    "~": 1716, "×": 1716, "·": 651, "±": 1716, "…": 2048, "▸": 1260, "≥": 1716,
    **dict.fromkeys("0123456789", 1303),
    **dict(zip("abcdefghijklmnopqrstuvwxyz", (
        1255, 1300, 1126, 1300, 1260, 721, 1300, 1298, 569, 569, 1186, 569, 1995, 1298, 1253,
        1300, 1300, 842, 1067, 803, 1298, 1212, 1675, 1212, 1212, 1075), strict=True)),
    **dict(zip("ABCDEFGHIJKLMNOPQRSTUVWXYZ", (
        1401, 1405, 1430, 1577, 1294, 1178, 1587, 1540, 604, 604, 1343, 1141, 1767, 1532, 1612,
        1235, 1612, 1423, 1300, 1251, 1499, 1401, 2025, 1403, 1251, 1405), strict=True)),
}  # fmt: skip
BOLD = 1.12  # DejaVu Sans Bold against the regular weight, at most


def text_width(text: str, size: float = 12.0, *, bold: bool = False) -> float:
    """Pixels ``text`` takes at ``size`` pixels (at most, in the common fonts).

    >>> round(text_width("fsdp1 FULL_SHARD", 12))
    115
    """
    units = sum(_WIDTHS.get(ch, _EM) for ch in text)
    return units / _EM * size * (BOLD if bold else 1.0)
