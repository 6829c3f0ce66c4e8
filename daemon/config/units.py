"""Value grammar of the configuration: byte sizes, shares of memory, seconds, flags' text.

Contract
========

- ``parse_byte_size(value, allow_percent=False)``: ``kvtier.tiers.units``'
  byte-size grammar (``"8GiB"``, ``"1.5GB"``, ints) plus ``"30%"`` ->
  ``MemoryFraction(0.3)`` where a share of available memory is allowed.
  Raises ``ValueError`` with a message fit for a ``ConfigError``.
- The converters ``_as_<kind>(value, text)`` read one raw value. ``text`` is
  True for environment variables and flags (every value is a string there)
  and False for TOML (values are typed). They raise ``ValueError`` naming
  what was expected; the caller adds the key and the source. ``auto``/
  ``off``/``none`` (and the empty string) mean "unset" for optional values.
- Nothing here knows a key's name: ``schema`` says which converter reads
  which key.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.daemon.config.errors import ConfigError
from kvtier.tiers import units as tier_units

__all__ = ["Coerce", "CpuBytes", "MemoryFraction", "parse_byte_size"]


@dataclass(frozen=True)
class MemoryFraction:
    """A share of the host's available memory, e.g. ``"30%"`` -> ``MemoryFraction(0.3)``."""

    fraction: float

    def __post_init__(self) -> None:
        if not (isinstance(self.fraction, float) and 0.0 < self.fraction <= 1.0):
            raise ConfigError("fraction", f"must be a float in (0, 1], got {self.fraction!r}")

    def of(self, total_bytes: int) -> int:
        return int(total_bytes * self.fraction)

    def __str__(self) -> str:
        return f"{self.fraction * 100:g}%"


CpuBytes = int | MemoryFraction


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_PERCENT_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*")


def parse_byte_size(value: object, *, allow_percent: bool = False) -> int | MemoryFraction:
    """``8GiB`` -> 8589934592; ints pass through; ``"30%"`` -> MemoryFraction when allowed.

    The grammar is ``kvtier.tiers.units.parse_byte_size``'s (the one every
    kvtier command line uses); this adds the percentage ``cpu_bytes`` takes.
    Raises ``ValueError`` with a message fit for a ``ConfigError``.
    """
    if isinstance(value, str) and not value.strip().startswith("-"):
        percent = _PERCENT_RE.fullmatch(value)
        if percent:
            if not allow_percent:
                raise ValueError(f"a percentage is only accepted for cpu_bytes, got {value!r}")
            pct = float(percent.group(1))
            if not 0.0 < pct <= 100.0:
                raise ValueError(f"percentage must be in (0, 100], got {value!r}")
            return MemoryFraction(pct / 100.0)
    return tier_units.parse_byte_size(value)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_UNSET = {"auto", "off", "none", ""}

# How each key's value is read. ``text`` is True for environment variables and
# flags (everything is a string there) and False for TOML (values are typed).
Coerce = Callable[[object, bool], object]


def _as_number(value: object, text: bool, what: str) -> float:
    if text and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"must be {what}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be {what}, got {type(value).__name__} {value!r}")
    return float(value)


def _as_float(value: object, text: bool) -> float:
    return _as_number(value, text, "a number of seconds")


def _as_share(value: object, text: bool) -> float:
    return _as_number(value, text, "a number in (0, 1]")


def _as_optional_float(value: object, text: bool) -> float | None:
    if isinstance(value, str) and value.strip().lower() in _UNSET:
        return None
    return _as_float(value, text)


def _as_int(value: object, text: bool) -> int:
    if text and isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise ValueError(f"must be an integer, got {value!r}") from None
    if not _is_int(value):
        raise ValueError(f"must be an integer, got {type(value).__name__} {value!r}")
    assert isinstance(value, int)
    return value


def _as_optional_int(value: object, text: bool) -> int | None:
    if isinstance(value, str) and value.strip().lower() in _UNSET:
        return None
    return _as_int(value, text)


def _as_bool(value: object, text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"must be true or false, got {value!r}")


def _as_str(value: object, text: bool) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__} {value!r}")
    return value.strip() if text else value


def _as_optional_url(value: object, text: bool) -> str | None:
    url = _as_str(value, text)
    return None if url.lower() in ("", "off", "none") else url


def _as_optional_dir(value: object, text: bool) -> Path | None:
    raw = _as_str(value, text).strip()
    return None if raw.lower() in ("", "off", "none") else Path(raw)


def _as_lower_str(value: object, text: bool) -> str:
    return _as_str(value, text).strip().lower()


def _as_log_level(value: object, text: bool) -> str:
    level = _as_lower_str(value, text)
    return "warning" if level == "warn" else level


def _as_device(value: object, text: bool) -> str:
    device = _as_lower_str(value, text)
    return "cuda:0" if device == "cuda" else device


def _as_path(value: object, text: bool) -> Path:
    return Path(_as_str(value, text))


def _as_optional_path(value: object, text: bool) -> Path | None:
    if text and isinstance(value, str) and value.strip().lower() in {"none", ""}:
        return None
    return Path(_as_str(value, text))


def _as_mode(value: object, text: bool) -> int:
    # TOML can write 0o660 (an int); text and TOML strings spell it "0660".
    if _is_int(value):
        return value  # type: ignore[return-value]
    if isinstance(value, str):
        digits = value.strip().lower().removeprefix("0o")
        if re.fullmatch(r"[0-7]{3,4}", digits):
            return int(digits, 8)
    raise ValueError(f'must be an octal file mode such as "0600" or "0660" (TOML: 0o660 or "0660"), got {value!r}')


def _as_size(value: object, text: bool) -> int:
    result = parse_byte_size(_as_text_int(value, text))
    assert isinstance(result, int)
    return result


def _as_optional_size(value: object, text: bool) -> int | None:
    if isinstance(value, str) and value.strip().lower() in _UNSET - {"off"}:
        return None
    return _as_size(value, text)


def _as_optional_cpu_size(value: object, text: bool) -> CpuBytes | None:
    if isinstance(value, str) and value.strip().lower() in _UNSET - {"off"}:
        return None
    return parse_byte_size(_as_text_int(value, text), allow_percent=True)


def _as_text_int(value: object, text: bool) -> object:
    # "4096" from the environment is a byte count, as 4096 in TOML is.
    if text and isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return value
