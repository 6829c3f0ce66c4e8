"""The replay's progress bar: tqdm when the tools extra is installed, else nothing."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["NoBar", "progress_bar"]


def progress_bar(total: int, desc: str, enabled: bool | None) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # tools extra not installed: no bar
        enabled = False
    if enabled is False:
        return NoBar()
    return tqdm(total=total, desc=desc, unit="req" if desc == "replay" else "run", file=sys.stderr,
                disable=None if enabled is None else False, leave=False, dynamic_ncols=True)


class NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
