"""Values that load but deserve a word: kvtierd prints one warning line for each.

Contract: ``cautions(cfg) -> list[tuple[str, str]]``: (dotted key, message)
for each setting that is allowed but exposes something or is probably not
what was meant. ``load_config_or_exit`` prints each as ``kvtierd: config
warning: <key>: <message>`` on stderr (with ``--print-config`` too) and goes
on. Nothing here refuses a value: that is the schema's.

- ``metrics_host`` that is not a loopback address, while ``metrics_port``
  is set: the Prometheus endpoint has no authentication, and its series
  name pools, tenants and their traffic.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.daemon.config.schema import DaemonConfig

__all__ = ["cautions"]


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def cautions(cfg: DaemonConfig) -> list[tuple[str, str]]:
    """See the module docstring."""
    out: list[tuple[str, str]] = []
    if cfg.metrics_port is not None and not _is_loopback(cfg.metrics_host):
        out.append(("metrics_host", f"{cfg.metrics_host} is not a loopback address: the Prometheus endpoint on port "
                                    f"{cfg.metrics_port} has no authentication and its series name pools, tenants and "
                                    "their traffic; bind 127.0.0.1 unless a firewall keeps the port private"))
    return out
