"""Pin tags released, and by which request: a pin asked for before its tag's release never outlives it.

A client ends a request's pins with ``unpin`` of its tag alone, those whose
replies it never read included (a batch given up at its deadline). That
batch's requests may still be on their way: sent on a connection the client
then gave up, they can reach the loop after the release, which the client
sent on its new connection, and would pin under the released tag until the
session ends. Request ids grow with every request a client sends
(docs/protocol.md: a counter; the Python client's counts across its
sockets), so a pinning request under a released tag whose id is below the
release's was sent before it: it pins nothing.

Contract (the event loop's thread only; used by ``daemon.handlers``):

- ``PinReleases(max_entries=MAX_RELEASES)``: the latest release of each
  (session, tag), daemon-wide; past ``max_entries`` the oldest releases are
  forgotten (a request that late pins as before). Each costs ~200 bytes
  whatever the tag's length (keyed by a 16-byte digest).
- ``release(sid, tag, request_id)``: ``tag`` of session ``sid`` was
  released by request ``request_id``.
- ``stale(sid, tag, request_id) -> bool``: a pinning request under ``tag``
  was sent before the tag's latest release.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

__all__ = ["MAX_RELEASES", "PinReleases"]

# 16,384 releases (~3 MiB): a request that outlives as many later releases by all clients was
# queued for seconds at the least.
MAX_RELEASES = 1 << 14
_PERSON = b"kvtier-pintag"


def _key(sid: str, tag: str) -> bytes:
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    h.update(sid.encode())
    h.update(b"\0")  # sids are hex: the tag starts here
    h.update(tag.encode("utf-8", "surrogatepass"))
    return h.digest()


class PinReleases:
    """See the module docstring."""

    def __init__(self, max_entries: int = MAX_RELEASES) -> None:
        self.max_entries = max_entries
        self._released: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._released)

    def release(self, sid: str, tag: str, request_id: int) -> None:
        key = _key(sid, tag)
        self._released[key] = max(request_id, self._released.pop(key, 0))
        while len(self._released) > self.max_entries:
            self._released.popitem(last=False)

    def stale(self, sid: str, tag: str, request_id: int) -> bool:
        released = self._released.get(_key(sid, tag))
        return released is not None and request_id < released
