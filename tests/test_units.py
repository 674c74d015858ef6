"""Human sizes: printed with three significant digits and no exponent at any unit boundary."""

from __future__ import annotations

import pytest

from autoshard.errors import ConfigError
from autoshard.units import format_bytes, format_count, format_share, parse_size

MIB, GIB, TIB = 2**20, 2**30, 2**40


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (int(9.996 * MIB), "10 MiB"),
        (int(99.96 * MIB), "100 MiB"),
        (int(999.4 * MIB), "999 MiB"),
        (int(999.6 * MIB), "1,000 MiB"),
        (int(1023.4 * MIB), "1,023 MiB"),
        (GIB, "1 GiB"),
        (int(6.713 * GIB), "6.71 GiB"),
        (-3 * GIB, "-3 GiB"),
        (5000 * TIB, "5,000 TiB"),
    ],
)
def test_format_bytes(value: int, text: str) -> None:
    assert format_bytes(value) == text
    assert "e+" not in format_bytes(value)


@pytest.mark.parametrize(
    ("share", "text"),
    [(0.0, "0%"), (0.446, "45%"), (0.01, "1%"), (0.0042, "0.4%"), (0.00004, "<0.1%")],
)
def test_a_small_share_is_not_rounded_to_zero(share: float, text: str) -> None:
    assert format_share(share) == text


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("40GB", 40 * 1000**3),  # decimal: what GPU vendors print (an A100 40GB)
        ("40gb", 40 * 1000**3),
        ("1.5TB", 1_500_000_000_000),
        ("900MB", 900 * 1000**2),
        ("80GiB", 80 * GIB),  # binary: what nvidia-smi prints
        ("24000MiB", 24000 * MIB),
        ("2TiB", 2 * TIB),
        ("512KiB", 512 * 1024),
        (" 8 GiB ", 8 * GIB),
        (4096, 4096),  # an int is bytes
    ],
)
def test_decimal_and_binary_units_are_not_confused(text: str | int, size: int) -> None:
    # 40GB read as GiB would be 7% too much memory (or bandwidth) on every plan
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["80", "80 GiBs", "eighty GB", "-1GB", "0GB", 0, True])
def test_a_size_that_cannot_be_read_says_how_to_write_it(text: str | int) -> None:
    with pytest.raises(ConfigError, match="--gpu-memory"):
        parse_size(text, flag="--gpu-memory")


def test_sizes_at_their_boundaries() -> None:
    # exactly 999.5 of a unit rounds to 1,000 (never "1e+03"); a share of exactly 0.1% shows
    assert format_bytes(int(999.5 * MIB)) == "1,000 MiB"
    assert format_share(0.001) == "0.1%"
    # the smallest positive size is one byte, as an int or as text
    assert parse_size(1) == 1 and parse_size("1B") == 1
    # without a flag name, the message says "size"
    with pytest.raises(ConfigError, match=r"^size: cannot read 'eighty GB'"):
        parse_size("eighty GB")
    with pytest.raises(ConfigError, match=r"^size 80: give a unit, e.g. 80GiB$"):
        parse_size("80")


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (6_738_415_616, "6.74B"),
        (124_439_808, "124M"),
        (8_192, "8.19K"),
        (1_000, "1K"),
        (1_000_000, "1M"),
        (1e9, "1B"),
        (1e12, "1T"),
        (2e12, "2T"),
        (999, "999"),
        (-2_500_000_000, "-2.5B"),
    ],
)
def test_parameter_counts_for_people(count: float, text: str) -> None:
    assert format_count(count) == text
