"""Daemon-level counters: a flat, label-aware dict that exporters can read.

Contract:

- ``Counters.inc(name, n=1, **labels)`` adds to a monotonically increasing
  counter; ``set(name, value, **labels)`` sets a gauge. Names are snake_case
  with their unit as suffix where they have one (``_bytes``, ``_s``).
- ``snapshot()`` returns ``{name: value}`` for unlabelled series and
  ``{name: {"label=value,...": value}}`` for labelled ones: plain msgpack/JSON
  data for the ``stats`` verb.
- ``series_key(name, **labels)`` names one series once, and ``add(key, n=1)``
  adds to it: the same as ``inc`` without building the key again (the loop's
  per-request counters, keyed per op).
- ``series()`` yields ``(name, labels_dict, value)`` for a Prometheus-style
  exporter.

Only the event-loop thread writes; readers on other threads get a
consistent-enough view (a dict copy under the GIL), which is all an exporter
needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


SeriesKey = tuple[str, tuple[tuple[str, str], ...]]


class Counters:
    """See the module docstring."""

    def __init__(self) -> None:
        self._values: dict[SeriesKey, float] = {}

    @staticmethod
    def series_key(name: str, **labels: Any) -> SeriesKey:
        return Counters._key(name, labels)

    def add(self, key: SeriesKey, n: float = 1) -> None:
        values = self._values
        values[key] = values.get(key, 0) + n

    @staticmethod
    def _key(name: str, labels: dict[str, Any]) -> SeriesKey:
        # The loop counts several series per request: skip the sort for the
        # usual none or one label.
        if not labels:
            return name, ()
        if len(labels) == 1:
            ((k, v),) = labels.items()
            return name, ((k, str(v)),)
        return name, tuple(sorted((k, str(v)) for k, v in labels.items()))

    def inc(self, name: str, n: float = 1, **labels: Any) -> None:
        key = self._key(name, labels)
        self._values[key] = self._values.get(key, 0) + n

    def set(self, name: str, value: float, **labels: Any) -> None:
        self._values[self._key(name, labels)] = value

    def get(self, name: str, **labels: Any) -> float:
        return self._values.get(self._key(name, labels), 0)

    def series(self) -> Iterator[tuple[str, dict[str, str], float]]:
        for (name, labels), value in list(self._values.items()):
            yield name, dict(labels), value

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, labels, value in self.series():
            if not labels:
                out[name] = value
            else:
                label_key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                out.setdefault(name, {})[label_key] = value
        return out
