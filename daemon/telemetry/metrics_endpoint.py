"""The Prometheus HTTP endpoint: ``/metrics`` from one thread, whatever the clients do.

Contract
========

- ``start_exporter(host, port, snapshot)`` serves ``GET /metrics`` (and
  ``/``) on ``host:port`` and returns an ``Exporter`` whose ``close()``
  stops it. Raises ``OSError`` when the port is taken and ``RuntimeError``
  when prometheus-client (a dependency of kvtier) cannot be imported:
  kvtierd treats both as "cannot serve" (exit 1).
- One thread runs an asyncio loop that owns every connection; a second
  renders the text (``generate_latest``: its collector may wait up to
  ``wait_s`` for the event loop's snapshot, ``daemon.telemetry.prometheus``), one
  scrape at a time. So an idle or slow connection costs a descriptor and a
  coroutine, never a thread.
- A connection must send its request head (at most ``MAX_REQUEST_BYTES``)
  within ``CONNECTION_TIMEOUT_S`` and read the reply within as long again;
  otherwise it is dropped. At most ``MAX_CONNECTIONS`` are open at once;
  past that a new one is closed at once (a scraper retries at its next
  interval). One request per connection (``Connection: close``); other
  methods get 405, other paths 404.

Imports prometheus-client only in ``start_exporter``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.daemon.telemetry.prometheus import DEFAULT_WAIT_S, StatsCollector, StatsSnapshot

log = logging.getLogger(__name__)

CONNECTION_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
MAX_REQUEST_BYTES = 8192  # a scrape's head is a few hundred bytes


class Exporter:
    """A running ``/metrics`` endpoint; ``close()`` stops it."""

    def __init__(self, host: str, port: int, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                 stop: asyncio.Event) -> None:
        self.host = host
        self.port = port
        self._loop = loop
        self._thread = thread
        self._stop = stop
        self.refused = 0  # connections closed at once, past MAX_CONNECTIONS

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout_s: float = 2.0) -> None:
        try:
            self._loop.call_soon_threadsafe(self._stop.set)
        except RuntimeError:
            return  # its loop has ended already
        self._thread.join(timeout_s)


class _Endpoint:
    """The connections of one exporter (its loop's thread only)."""

    def __init__(self, render: Any, content_type: str) -> None:
        self.render = render
        self.content_type = content_type
        self.open_connections = 0
        self.exporter: Exporter | None = None
        self._renderer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-metrics-render")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open_connections >= MAX_CONNECTIONS:
            if self.exporter is not None:
                self.exporter.refused += 1
            writer.close()
            return
        self.open_connections += 1
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CONNECTION_TIMEOUT_S)
            status, body, content_type = await self._answer(head)
            header = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                      "Connection: close\r\n\r\n").encode("latin-1")
            writer.write(header + (body if not head.startswith(b"HEAD ") else b""))
            await asyncio.wait_for(writer.drain(), CONNECTION_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # silent, slow, too long or gone: dropped
        finally:
            self.open_connections -= 1
            writer.close()

    async def _answer(self, head: bytes) -> tuple[str, bytes, str]:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3:
            return "400 Bad Request", b"bad request line\n", "text/plain"
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        if target not in (b"/metrics", b"/"):
            return "404 Not Found", b"GET /metrics\n", "text/plain"
        body = await asyncio.get_running_loop().run_in_executor(self._renderer, self.render)
        return "200 OK", body, self.content_type

    def shutdown(self) -> None:
        self._renderer.shutdown(wait=False, cancel_futures=True)


def start_exporter(host: str, port: int, snapshot: StatsSnapshot, *, wait_s: float = DEFAULT_WAIT_S,
                   process_metrics: bool = True) -> Exporter:
    """Serve ``http://host:port/metrics``; see the module docstring."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
    except ImportError as exc:
        raise RuntimeError(f"metrics_port is set but prometheus-client, a kvtier dependency, cannot be imported "
                           f"({exc}; pip install 'prometheus-client>=0.17', or leave metrics_port off)") from exc

    # A registry of our own: the default one would add this process's Python
    # GC and platform series and anything else that registered globally.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(snapshot, wait_s=wait_s))  # type: ignore[arg-type]
    if process_metrics:
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, cpu seconds, open fds
    endpoint = _Endpoint(lambda: generate_latest(registry), CONTENT_TYPE_LATEST)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    outcome: dict[str, Any] = {}

    async def serve() -> None:
        stop = asyncio.Event()
        try:
            server = await asyncio.start_server(endpoint.handle, host, port, limit=MAX_REQUEST_BYTES)
        except OSError as exc:
            outcome["error"] = exc
            started.set()
            return
        outcome["port"] = int(server.sockets[0].getsockname()[1])
        outcome["stop"] = stop
        started.set()
        async with server:
            await stop.wait()
        endpoint.shutdown()

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="kvtier-metrics", daemon=True)
    thread.start()
    started.wait()
    if "error" in outcome:
        thread.join()
        raise outcome["error"]
    exporter = Exporter(host, outcome["port"], loop, thread, outcome["stop"])
    endpoint.exporter = exporter
    log.info("metrics at %s", exporter.url)
    return exporter
