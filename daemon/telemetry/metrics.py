"""Daemon-level counters: a flat, label-aware dict that exporters can read.

Contract:

- ``Counters.inc(name, n=1, **labels)`` adds to a monotonically increasing
  counter; ``set(name, value, **labels)`` sets a gauge. Names are snake_case
  with their unit as suffix where they have one (``_bytes``, ``_s``).
- ``snapshot()`` returns ``{name: value}`` for unlabelled series and
  ``{name: {"label=value,...": value}}`` for labelled ones: plain msgpack/JSON
  data for the ``stats`` verb.
- ``series()`` yields ``(name, labels_dict, value)`` for a Prometheus-style
  exporter.

Only the event-loop thread writes; readers on other threads get a
consistent-enough view (a dict copy under the GIL), which is all an exporter
needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class Counters:
    """See the module docstring."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    @staticmethod
    def _key(name: str, labels: dict[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
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
