"""Byte sizes and counts as people write them: one grammar for every kvtier command line.

Two parsers, on purpose, because the same letters mean different things for
bytes and for counts:

- ``parse_byte_size("128K")`` -> 131,072. **Bytes**: an integer, or a
  number with a unit. ``K``/``M``/``G``/``T``, ``Ki``/``Mi``/``Gi``/``Ti`` and
  ``KiB``/``MiB``/``GiB``/``TiB`` are powers of 1024; ``KB``/``MB``/``GB``/``TB``
  powers of 1000; ``B`` is bytes. Case-insensitive, blanks allowed around
  the unit, a fractional number is rounded down to whole bytes
  (``"0.5KiB"`` -> 512). kvtierd's sizes (TOML, ``KVTIER_*``, flags) and
  ``kvtier replay --block-bytes`` read this.
- ``parse_count("128k")`` -> 128,000. **Counts** (tokens, blocks): an
  integer, or a number with ``k``/``M``/``G`` (powers of 1000) or
  ``Ki``/``Mi``/``Gi`` (powers of 1024); the result must be whole.
  ``kvtier replay``'s ``--*-tokens`` and ``--*-blocks`` read this.

``format_byte_size`` writes a byte size back in the grammar (exact binary
unit when there is one) and ``format_gib`` is the one human-readable GiB
figure of logs and errors. Stdlib only.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["GiB", "KiB", "MiB", "TiB", "format_byte_size", "format_gib", "parse_byte_size", "parse_count"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "ki": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mi": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gi": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": TiB,
    "ti": TiB,
    "tib": TiB,
    "tb": 1000**4,
}
_BYTE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")

_COUNT_UNITS: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
_COUNT_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kKmMgG]i?)?\s*")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_byte_size(value: object) -> int:
    """``"8GiB"`` -> 8589934592, ``"128K"`` -> 131072, ``"1.5GB"`` -> 1500000000; ints pass through.

    Raises ``ValueError`` (negative, not a size, unknown unit) with a message
    that names the value.
    """
    if _is_int(value):
        assert isinstance(value, int)
        if value < 0:
            raise ValueError(f"must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"must be a byte size such as 8GiB or 512MiB, got {value!r}")
    if value.strip().startswith("-"):
        raise ValueError(f"must not be negative, got {value!r}")
    match = _BYTE_RE.fullmatch(value)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _BYTE_UNITS:
        raise ValueError(f"must be a byte size such as 8GiB, 512MiB, 1.5GB or 4096, got {value!r}")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:
        raise ValueError(f"bad number in byte size {value!r}") from None
    return int(number * _BYTE_UNITS[unit])


def parse_count(text: str) -> int:
    """``"3M"`` -> 3_000_000, ``"100k"`` -> 100_000, ``"1.5M"``, ``"64Ki"`` -> 65536; plain integers too.

    For counts of tokens or blocks, never bytes (``parse_byte_size``). Raises
    ``ValueError`` for anything else, a negative or a fractional result.
    """
    m = _COUNT_RE.fullmatch(text)
    if not m:
        raise ValueError(f"not a count: {text!r} (e.g. 195, 100k, 3M, 1.5M)")
    value = float(m.group(1)) * _COUNT_UNITS[(m.group(2) or "").lower()]
    if value != int(value):
        raise ValueError(f"not a whole number: {text!r}")
    return int(value)


def format_byte_size(value: int) -> str:
    """The exact binary-unit spelling when there is one (``"256MiB"``), else plain bytes."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value and value % scale == 0:
            return f"{value // scale}{unit}"
    return str(value)


def format_gib(nbytes: int | float, *, decimals: int = 2, thousands: bool = False) -> str:
    """``nbytes`` in GiB for people: ``"1.50 GiB"``; ``thousands=True`` groups digits (``"9,389.6 GiB"``)."""
    return f"{nbytes / GiB:{',' if thousands else ''}.{decimals}f} GiB"
