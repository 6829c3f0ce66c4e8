"""Tests for kvtier.tiers.units: the one byte-size grammar, the count parser, the GiB formatter."""

from __future__ import annotations

import pytest

from kvtier.tiers.units import GiB, KiB, MiB, format_byte_size, format_gib, parse_byte_size, parse_count


@pytest.mark.parametrize("text, expected", [
    ("128K", 128 * KiB), ("128k", 128 * KiB), ("128Ki", 128 * KiB), ("128KiB", 128 * KiB), ("128KB", 128_000),
    ("2M", 2 * MiB), ("2MB", 2_000_000), ("8GiB", 8 * GiB), ("0.5 TiB", 512 * GiB), ("10B", 10), ("4096", 4096),
    (4096, 4096), (".5KiB", 512), ("1.0000001KiB", 1024),
])
def test_byte_sizes_are_binary_unless_spelled_decimal(text: object, expected: int) -> None:
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("text", ["-1", -1, "8 GiBs", "abc", "", "1.2.3GiB", "GiB", 1.5, True, None, "1e9", "30%"])
def test_byte_size_rejects(text: object) -> None:
    with pytest.raises(ValueError):
        parse_byte_size(text)


def test_counts_are_decimal_unless_spelled_binary() -> None:
    assert parse_count("128k") == 128_000 and parse_count("128K") == 128_000 and parse_count("3M") == 3_000_000
    assert parse_count("1.5M") == 1_500_000 and parse_count("64Ki") == 65536 and parse_count("195") == 195
    for bad in ("", "x", "1.00001k", "-1", "1.5", "8KB"):
        with pytest.raises(ValueError):
            parse_count(bad)


def test_the_same_word_differs_only_between_bytes_and_counts() -> None:
    assert (parse_byte_size("128K"), parse_count("128K")) == (131_072, 128_000)


def test_formatters() -> None:
    assert format_byte_size(256 * MiB) == "256MiB" and format_byte_size(1000) == "1000"
    assert format_gib(3 * GiB // 2) == "1.50 GiB"
    assert format_gib(4194304 * GiB) == "4194304.00 GiB"
    assert format_gib(9389.6 * GiB, decimals=1, thousands=True) == "9,389.6 GiB"
