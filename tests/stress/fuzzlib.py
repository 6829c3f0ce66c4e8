"""Protocol fuzzing against a live kvtierd: frame generators, the world they aim at, and the judge.

Contract
========

- ``FuzzWorld.open(endpoint, block_bytes)`` builds what the frames aim at:
  fuzz sessions on the store-mode pools ``fuzz-a`` and ``fuzz-b`` (each
  with a shared-memory arena and a registered KV tensor) and one on the
  engine-mode pool ``fuzz-e`` (its registration is the pool's GPU tier),
  plus sids of sessions that already ended. It never touches the victim
  pool: frames may name the victim pool only with a layout that differs
  from it, and never carry the victim's sid (a sid is a bearer token; a
  "foreign" sid here is an unknown, ended or other-pool one).
  ``refresh()`` re-opens fuzz sessions that a fuzzed ``bye`` or a hostile
  ``lease_s`` ended.
- ``FrameGen(rng, world).next() -> FuzzCase``: one message, seeded and
  reproducible, from one of ``CATEGORIES``: random bytes, truncated and
  bit-flipped valid requests, wrong field types, msgpack headers that
  declare huge lengths or deep nesting, wrong frame counts, valid headers
  with hostile field values (negative, enormous or off-by-one slots, ids,
  token counts, leases, layouts, arena names), foreign session ids, and
  well-formed requests (so fuzzing also walks the paths behind validation).
- ``hypothesis_requests(world)``: a Hypothesis strategy for the same space
  of structured requests (any op, any subset of its fields with any
  msgpack value, any sid, 0..3 payload frames).
- ``Judge.send(case)`` sends one case on its own DEALER socket and checks
  the reply: exactly one, within ``reply_timeout_s``; a v1 map; the
  request's id when the daemon could read it, else 0; ``ok`` a bool; an
  error map with a known code, its name and a message; and never
  ``INTERNAL`` (a daemon bug). Frames above the hard limit (libzmq
  ``MAXMSGSIZE``) expect no reply and a dropped connection. ``Judge``
  tallies cases per category, replies per error name, and the failures.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from kvtier.client.client import Client, KvtierError, PoolLayout
from kvtier.client.protocol import (
    MAX_HASHES,
    MAX_HEADER_BYTES,
    OPS,
    ErrorCode,
    ProtocolError,
    decode_header,
    encode,
    recoverable_id,
)

CATEGORIES = (
    "random_bytes",
    "truncated",
    "bit_flips",
    "wrong_types",
    "huge_lengths",
    "frame_counts",
    "hostile_values",
    "foreign_sessions",
    "well_formed",
)
FUZZ_POOLS = ("fuzz-a", "fuzz-b")
ENGINE_POOL = "fuzz-e"
ARENA_SLOTS = 8
KV_BLOCKS = 8
# Hostile scalars: signed/unsigned edges, floats that break arithmetic, odd strings.
EDGE_INTS = (-1, -(2**31), -(2**63), 0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**40, 2**40 + 1, 2**53 + 1,
             2**63 - 1, 2**63, 2**64 - 1)
EDGE_FLOATS = (float("nan"), float("inf"), float("-inf"), -0.0, 1e-300, 1e300, -1.0, 0.5)
EDGE_STRS = ("", "\x00", "a" * 300, "../../etc/passwd", "kvtier-../x", "ünïcødé", "kvtier-", " ", "%s%n")


@dataclass
class FuzzCase:
    category: str
    frames: list[bytes]
    note: str = ""


# Error replies the harness's own clients (fuzz sessions, the victim) got: with
# the judge's tally they account for every error the daemon counted.
HARNESS_ERRORS: Counter[str] = Counter()


class CountingClient(Client):
    """A ``Client`` that tallies the error replies it gets in ``HARNESS_ERRORS``."""

    def _roundtrip(self, *args: Any, **kw: Any) -> Any:  # type: ignore[override]
        from kvtier.client.client import DaemonError

        try:
            return super()._roundtrip(*args, **kw)
        except DaemonError as exc:
            HARNESS_ERRORS[exc.name] += 1
            raise


@dataclass
class FuzzSession:
    pool: str
    client: Client
    reg: str | None = None
    reg_blocks: int = 0

    @property
    def sid(self) -> str:
        return self.client.sid or ""


class FuzzWorld:
    """The fuzz sessions and facts the frames aim at (see the module docstring)."""

    def __init__(self, endpoint: str, block_bytes: int, victim_pool: str, victim_layout: dict[str, Any],
                 max_payload_bytes: int) -> None:
        self.endpoint = endpoint
        self.block_bytes = block_bytes
        self.victim_pool = victim_pool
        self.victim_layout = dict(victim_layout)
        self.max_payload_bytes = max_payload_bytes
        self.hard_limit_bytes = 2 * max(MAX_HEADER_BYTES, max_payload_bytes)
        self.sessions: dict[str, FuzzSession] = {}
        self.dead_sids: list[str] = []
        self.known_hashes: list[bytes] = []
        self._kv_keep: list[Any] = []
        self.reopened = 0

    @classmethod
    def open(cls, endpoint: str, block_bytes: int, victim_pool: str, victim_layout: dict[str, Any],
             max_payload_bytes: int) -> FuzzWorld:
        world = cls(endpoint, block_bytes, victim_pool, victim_layout, max_payload_bytes)
        for pool in (*FUZZ_POOLS, ENGINE_POOL):
            world._open_session(pool)
        # Sessions that ended: their sids must be refused, never revived.
        for _ in range(2):
            c = CountingClient(endpoint, FUZZ_POOLS[0], world.layout("store"), heartbeat=False)
            world.dead_sids.append(c.sid or "")
            c.close()
        return world

    def layout(self, mode: str) -> dict[str, Any]:
        return {**self.victim_layout, "model": "fuzz-model", "mode": mode}

    def _open_session(self, pool: str) -> None:
        from kvtier.client.kv_share import allocate_shared_kv

        mode = "engine" if pool == ENGINE_POOL else "store"
        client = CountingClient(self.endpoint, pool, PoolLayout(**self.layout(mode)), heartbeat=False, timeout_s=10.0)
        session = FuzzSession(pool, client)
        try:
            if mode == "store":
                client.open_arena(ARENA_SLOTS)
            kv, _handle = allocate_shared_kv((KV_BLOCKS, self.block_bytes // 2), "float16", 0)
            self._kv_keep.append(kv)
            session.reg_blocks = client.register_kv("kv", [kv], 0)
            session.reg = "kv"
            if mode == "store":
                hashes = [bytes([len(self.known_hashes) % 251, i]) * 8 for i in range(4)]
                client.store(hashes, bytes(4 * self.block_bytes))
                self.known_hashes += hashes
        except KvtierError:
            pass  # a half-built session still has a sid to aim at
        old = self.sessions.get(pool)
        if old is not None:
            self.dead_sids.append(old.sid)
            _close_quietly(old.client)
        self.sessions[pool] = session

    def refresh(self) -> int:
        """Re-open the fuzz sessions the fuzzing ended; returns how many."""
        n = 0
        for pool, session in list(self.sessions.items()):
            try:
                session.client.heartbeat(timeout_s=5.0)
                if session.client.sid == session.sid:
                    continue
            except KvtierError:
                pass
            self._open_session(pool)
            n += 1
        self.reopened += n
        del self._kv_keep[:-2 * len(self.sessions)]  # tensors of replaced sessions may go
        return n

    def close(self) -> None:
        for session in self.sessions.values():
            _close_quietly(session.client)
        self.sessions.clear()
        self._kv_keep.clear()

    def live_sids(self) -> list[str]:
        return [s.sid for s in self.sessions.values()]


def _close_quietly(client: Client) -> None:
    try:
        client.close(timeout_s=0.5)
    except Exception:  # the session may already be gone
        pass


# ---- frame generation --------------------------------------------------------


def pack(obj: Any, *, bin_type: bool = True) -> bytes:
    return msgpack.packb(obj, use_bin_type=bin_type)


class FrameGen:
    """Seeded generator of fuzz cases (see the module docstring)."""

    def __init__(self, rng: random.Random, world: FuzzWorld) -> None:
        self.rng = rng
        self.world = world
        self.next_id = 1_000_000
        self._makers = {
            "random_bytes": self.random_bytes,
            "truncated": self.truncated,
            "bit_flips": self.bit_flips,
            "wrong_types": self.wrong_types,
            "huge_lengths": self.huge_lengths,
            "frame_counts": self.frame_counts,
            "hostile_values": self.hostile_values,
            "foreign_sessions": self.foreign_sessions,
            "well_formed": self.well_formed,
        }

    def next(self, category: str | None = None) -> FuzzCase:
        category = category or self.rng.choice(CATEGORIES)
        return self._makers[category]()

    # -- building blocks --

    def rid(self) -> int:
        self.next_id += 1
        return self.next_id

    def hashes(self, n: int | None = None) -> list[bytes]:
        r = self.rng
        n = r.choice((0, 1, 2, 4, 9)) if n is None else n
        known = self.world.known_hashes
        return [r.choice(known) if known and r.random() < 0.6 else r.randbytes(16) for _ in range(n)]

    def session(self, pool: str | None = None) -> FuzzSession:
        sessions = self.world.sessions
        if pool is not None and pool in sessions:
            return sessions[pool]
        return sessions[self.rng.choice(sorted(sessions))]

    def valid_request(self) -> tuple[dict[str, Any], list[bytes]]:
        """A request that passes validation (its outcome still depends on state)."""
        r = self.rng
        bb = self.world.block_bytes
        op = r.choice(sorted(OPS))
        s = self.session(ENGINE_POOL if op in ("allocate", "append", "free") and r.random() < 0.8 else None)
        h: dict[str, Any] = {"v": 1, "op": op, "id": self.rid()}
        if OPS[op].session != "none":
            h["sid"] = s.sid
        frames: list[bytes] = []
        if op == "hello":
            pool = r.choice((*FUZZ_POOLS, ENGINE_POOL, self.world.victim_pool, f"fuzz-x{r.randrange(4)}"))
            mode = "engine" if pool == ENGINE_POOL else "store"
            lay = self.world.layout(mode)
            if pool == self.world.victim_pool:
                lay["num_layers"] += 1  # never a session on the victim pool: a mismatch
            h.update(pool=pool, layout=lay, client="fuzz")
            if r.random() < 0.3:
                h["lease_s"] = r.choice((0.001, 0.5, 3600))
        elif op in ("lookup", "pin", "unpin"):
            h["hashes"] = self.hashes()
            if op == "lookup":
                h["pin"] = r.random() < 0.3
        elif op in ("store", "restore"):
            n = r.choice((0, 1, 2, 3))
            h["hashes"] = self.hashes(n) if op == "restore" else [r.randbytes(16) for _ in range(n)]
            plane = r.choice(("inline", "shm", "kv"))
            h["plane"] = plane
            if plane == "inline":
                if op == "store" and n:
                    frames = [r.randbytes(n * bb)]
            else:
                limit = ARENA_SLOTS if plane == "shm" else KV_BLOCKS
                h["slots"] = r.sample(range(limit), n)
                if plane == "kv":
                    h["reg"] = "kv"
        elif op == "allocate":
            nb = r.choice((0, 1, 2, 3))
            h.update(req=f"r{r.randrange(4)}", hashes=self.hashes(nb), num_tokens=nb * 4 + r.randrange(4))
        elif op == "append":
            h.update(req=f"r{r.randrange(4)}", num_tokens=r.randrange(6), hashes=self.hashes(r.choice((0, 1))))
        elif op == "free":
            h["req"] = f"r{r.randrange(4)}"
        elif op == "attach_arena":
            h.update(name=f"kvtier-fuzz{r.randrange(1000)}", num_slots=r.randrange(1, 9), slot_bytes=bb)
        elif op in ("register_kv", "unregister_kv"):
            h["name"] = r.choice(("kv", "other"))
            if op == "register_kv":
                h["tensors"] = [{"desc": {"version": 1, "transport": "shm", "dtype": "float16", "shape": [8, bb // 2],
                                          "stride": [bb // 2, 1], "storage_offset": 0,
                                          "handle": {"kind": "shm", "name": "kvtier-kv-nothere", "size_bytes": 8 * bb}},
                                 "block_dim": 0}]
        elif op == "clear" and s.pool == ENGINE_POOL:
            pass
        return h, frames

    def any_value(self, depth: int = 0) -> Any:
        r = self.rng
        kind = r.randrange(9 if depth < 2 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return r.random() < 0.5
        if kind == 2:
            return r.choice(EDGE_INTS)
        if kind == 3:
            return r.choice(EDGE_FLOATS)
        if kind == 4:
            return r.choice(EDGE_STRS)
        if kind == 5:
            return r.randbytes(r.choice((0, 1, 15, 16, 17, 64)))
        if kind == 6:
            return [self.any_value(depth + 1) for _ in range(r.randrange(4))]
        if kind == 7:
            return {r.choice(("a", "desc", "block_dim", "kind", "")): self.any_value(depth + 1) for _ in range(r.randrange(3))}
        return [r.randbytes(16)] * r.choice((1, 3))

    def encode_case(self, category: str, h: dict[str, Any], frames: list[bytes], note: str = "") -> FuzzCase:
        return FuzzCase(category, [pack(h, bin_type=self.rng.random() > 0.05), *frames], note)

    # -- categories --

    def random_bytes(self) -> FuzzCase:
        r = self.rng
        n = r.choice((0, 1, 2, 5, 16, 100, 1000, 5000))
        return FuzzCase("random_bytes", [r.randbytes(n)] + [r.randbytes(r.randrange(64)) for _ in range(r.randrange(3))])

    def truncated(self) -> FuzzCase:
        h, frames = self.valid_request()
        data = encode(h)
        cut = self.rng.randrange(len(data))
        return FuzzCase("truncated", [data[:cut], *frames], h["op"])

    def bit_flips(self) -> FuzzCase:
        r = self.rng
        h, frames = self.valid_request()
        data = bytearray(encode(h))
        for _ in range(r.choice((1, 1, 2, 4, 8))):
            i = r.randrange(len(data))
            what = r.randrange(4)
            if what == 0:
                data[i] ^= 1 << r.randrange(8)
            elif what == 1:
                data[i] = r.randrange(256)
            elif what == 2 and len(data) > 1:
                del data[i]
            else:
                data.insert(i, r.randrange(256))
        return FuzzCase("bit_flips", [bytes(data), *frames], h["op"])

    def wrong_types(self) -> FuzzCase:
        r = self.rng
        h, frames = self.valid_request()
        fields = [k for k in h if k not in ("v", "op", "id", "sid")]
        for _ in range(r.choice((1, 1, 2))):
            # Mostly the op's own fields (the handlers' input); sometimes the header's.
            key = r.choice(fields) if fields and r.random() < 0.75 else r.choice(("v", "op", "id", "sid", "bogus"))
            h[key] = self.any_value()
        if r.random() < 0.2 and isinstance(h.get("layout"), dict) and h["layout"]:
            lay = dict(h["layout"])
            lay[r.choice(sorted(lay))] = self.any_value()
            h["layout"] = lay
        if r.random() < 0.1:
            h[r.choice((1, -1, b"k", 2.5))] = 1  # non-string map keys
        return self.encode_case("wrong_types", h, frames, str(h.get("op")))

    def huge_lengths(self) -> FuzzCase:
        r = self.rng
        big = r.choice((2**16, 2**31 - 1, 2**32 - 1))
        fields = {"v": 1, "op": "lookup", "id": self.rid(), "sid": self.session().sid}
        # A real header whose map declares one entry more: the last, "hashes", is the hostile value.
        prefix = bytes([0x80 | (len(fields) + 1)]) + b"".join(pack(k) + pack(v) for k, v in fields.items()) + pack("hashes")
        heads = (
            b"\xdb" + big.to_bytes(4, "big") + b"abc",  # str32 claiming `big` bytes
            b"\xc6" + big.to_bytes(4, "big") + b"abc",  # bin32
            b"\xdd" + big.to_bytes(4, "big") + b"\x01",  # array32
            b"\xdf" + big.to_bytes(4, "big") + b"\xa1a\x01",  # map32
            b"\xc9" + big.to_bytes(4, "big") + b"\x01x",  # ext32
            b"\x91" * r.choice((100, 1000, 100_000)) + b"\xc0",  # deep nesting
            b"\x81\xa6hashes\xdd" + (MAX_HASHES + 1).to_bytes(4, "big") + b"\xc4\x10" + b"\0" * 16,
        )
        head = r.choice(heads)
        # Either on its own, or as the value of the last field of a real header.
        data = head if r.random() < 0.5 else prefix + head
        if r.random() < 0.05:
            # Just over the soft header limit: a TOO_LARGE reply, never decoded.
            data = b"\x00" * (MAX_HEADER_BYTES + r.randrange(1, 1024))
        return FuzzCase("huge_lengths", [data])

    def frame_counts(self) -> FuzzCase:
        r = self.rng
        h, frames = self.valid_request()
        choice = r.randrange(6) if r.random() > 0.002 else 6
        bb = self.world.block_bytes
        if choice == 0:
            extra = [b""]  # an empty payload frame
        elif choice == 1:
            extra = [r.randbytes(bb) for _ in range(r.randrange(2, 5))]
        elif choice == 2:
            extra = [r.randbytes(r.choice((1, bb - 1, bb + 1, 3 * bb)))]
        elif choice == 3:
            return FuzzCase("frame_counts", [b""], "empty header frame")
        elif choice == 4:
            # A payload between the soft and the hard limit: TOO_LARGE, connection kept.
            extra = [bytes(self.world.max_payload_bytes + r.randrange(1, bb))]
        elif choice == 5:
            extra = []
            frames = []
        else:
            # Over the hard limit (libzmq MAXMSGSIZE): the daemon never sees it; libzmq drops the connection.
            extra = [bytes(self.world.hard_limit_bytes + 1)]
            frames = []
        return FuzzCase("frame_counts", [encode(h), *extra, *frames], h["op"])

    def hostile_values(self) -> FuzzCase:
        r = self.rng
        h, frames = self.valid_request()
        op = h["op"]
        edge = r.choice(EDGE_INTS)
        if op in ("store", "restore") and h.get("plane") != "inline":
            slots = list(h.get("slots") or [0])
            slots[r.randrange(len(slots))] = r.choice((edge, ARENA_SLOTS, KV_BLOCKS, self.session().reg_blocks))
            h["slots"] = slots
            h["hashes"] = self.hashes(len(slots))
        elif op in ("allocate", "append"):
            h[r.choice(("num_tokens", "req"))] = edge if r.random() < 0.7 else r.choice(EDGE_STRS)
        elif op == "hello":
            lay = dict(h["layout"])
            key = r.choice(("block_size", "block_bytes", "num_layers", "kv_heads", "head_dim", "tp_rank", "tp_size"))
            lay[key] = r.choice((edge, 1, 2**20, 2**20 + 1))
            lay["model"] = f"hostile-{key}"
            h.update(pool=f"fuzz-h{r.randrange(3)}", layout=lay)
            if r.random() < 0.5:
                h["lease_s"] = r.choice(EDGE_FLOATS + (3600.0001, 1e-9))
        elif op == "attach_arena":
            h.update(name=r.choice(EDGE_STRS + ("kvtier-" + "a" * 201, "kvtier-a/b", "kvtier-" + "x" * 200)),
                     num_slots=r.choice((edge if edge >= 0 else 1, 2**32 - 1)), slot_bytes=r.choice((1, 2**40)))
        elif op == "register_kv":
            desc = h["tensors"][0]["desc"]
            key = r.choice(("shape", "stride", "storage_offset", "dtype", "handle"))
            desc[key] = r.choice(([edge, 1], [-1], edge, "float64x", {"kind": "shm", "name": "kvtier-kv-x",
                                                                    "size_bytes": edge}))
            h["tensors"][0]["block_dim"] = r.choice((0, 1, 16))
        elif op in ("lookup", "pin", "unpin") and r.random() < 0.7:
            # The largest hash lists: duplicates of one held block, and one over the limit.
            held = r.choice(self.world.known_hashes) if self.world.known_hashes else r.randbytes(16)
            h["hashes"] = [held] * r.choice((2, 1000, MAX_HASHES, MAX_HASHES + 1))
        elif "sid" in h and r.random() < 0.5:
            h["sid"] = r.choice(("0" * 32, "f" * 64, self.session().sid + "0", "\x00" * 32))
        else:
            h["id"] = r.choice((0, -1, 2**63, 2**64 - 1, 2**63 - 1))
        return self.encode_case("hostile_values", h, frames, op)

    def foreign_sessions(self) -> FuzzCase:
        r = self.rng
        h, frames = self.valid_request()
        if OPS[h["op"]].session == "none":
            h = {"v": 1, "op": "heartbeat", "id": self.rid()}
        choice = r.randrange(5)
        if choice == 0:
            h["sid"] = r.randbytes(16).hex()  # well-formed, unknown
        elif choice == 1 and self.world.dead_sids:
            h["sid"] = r.choice(self.world.dead_sids)  # ended
        elif choice == 2:
            # Another pool's live session naming this pool's resources (slots, regs, requests).
            h["sid"] = r.choice(self.world.live_sids())
        elif choice == 3:
            h["sid"] = r.choice(("", "x" * 65, "0" * 32, "../" * 10, self.world.live_sids()[0].upper()))
        else:
            h.pop("sid", None)
        return self.encode_case("foreign_sessions", h, frames, h["op"])

    def well_formed(self) -> FuzzCase:
        h, frames = self.valid_request()
        return FuzzCase("well_formed", [encode(h), *frames], h["op"])


def hypothesis_requests(world: FuzzWorld) -> Any:
    """Structured requests for Hypothesis: any op, any of its fields with any msgpack value (see module doc)."""
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
        st.text(max_size=40), st.binary(max_size=40), st.sampled_from(EDGE_INTS),
    )
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)
    hashes = st.lists(st.one_of(st.binary(min_size=16, max_size=16), st.sampled_from(world.known_hashes or [b"\0" * 16])),
                      max_size=6)
    field_values = st.one_of(values, hashes, st.lists(st.integers(-2, 2**33), max_size=4))
    sids = st.one_of(st.sampled_from(world.live_sids() + world.dead_sids), st.text(max_size=70), st.none(),
                     st.binary(max_size=32))

    @st.composite
    def request(draw: Any) -> list[bytes]:
        op = draw(st.one_of(st.sampled_from(sorted(OPS)), st.sampled_from(sorted(OPS)), st.text(max_size=12)))
        names = sorted(OPS[op].fields) if op in OPS else []
        keys = draw(st.lists(st.sampled_from(names + ["bogus"]), unique=True, max_size=len(names) + 1)) if names else []
        # Mostly a valid version and id (9 in 10), so most examples reach field validation and the handlers.
        valid_head = draw(st.integers(0, 9)) > 0
        header: dict[Any, Any] = {
            "v": 1 if valid_head else draw(st.sampled_from((0, 2, -1, "1", None))),
            "op": op,
            "id": draw(st.integers(1, 2**63 - 1)) if valid_head else draw(st.one_of(st.integers(-5, 0), values)),
        }
        sid = draw(sids)
        if sid is not None:
            header["sid"] = sid
        for key in keys:
            header[key] = draw(field_values)
        if op == "hello" and "pool" in header:
            # The victim pool is off limits to fuzz sessions (see FuzzWorld).
            header["pool"] = draw(st.sampled_from((*FUZZ_POOLS, "fuzz-hyp")))
        payload = draw(st.lists(st.binary(max_size=2 * world.block_bytes), max_size=3))
        # Mostly msgpack's bin type for bytes; sometimes the legacy raw type (bytes arrive as str).
        return [pack(header, bin_type=draw(st.sampled_from((True,) * 9 + (False,)))), *payload]

    return request()


# ---- judging replies -----------------------------------------------------------


def expected_reply_id(header_frame: bytes) -> int:
    """The id the daemon must answer with: the request's when readable, else 0."""
    try:
        return recoverable_id(decode_header(header_frame))
    except ProtocolError:
        return 0


@dataclass
class Judge:
    """Sends cases and checks each reply (see the module docstring)."""

    endpoint: str
    hard_limit_bytes: int
    reply_timeout_s: float = 5.0
    max_failures_kept: int = 50
    cases: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)  # "ok" or the error name
    by_category: dict[str, Counter[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    num_failures: int = 0
    dropped_connections: int = 0
    slowest_s: float = 0.0
    frames_sent: int = 0

    def __post_init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self._socket()

    def _socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def _fail(self, case: FuzzCase, why: str) -> None:
        self.num_failures += 1
        if len(self.failures) < self.max_failures_kept:
            self.failures.append(f"{case.category}/{case.note}: {why}; frames[0][:80]={case.frames[0][:80]!r}")

    def send(self, case: FuzzCase) -> str:
        """Send one case, check its reply; returns "ok", an error name, or "no_reply"."""
        self.cases[case.category] += 1
        self.frames_sent += len(case.frames)
        over_hard_limit = any(len(f) > self.hard_limit_bytes for f in case.frames)
        t0 = time.monotonic()
        self.sock.send_multipart(case.frames, copy=True)
        timeout_s = 1.0 if over_hard_limit else self.reply_timeout_s
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            if over_hard_limit:
                # libzmq dropped this peer's connection: reconnect, as a client would.
                self.dropped_connections += 1
                self.sock.close(linger=0)
                self.sock = self._socket()
                return self._tally(case, "no_reply")
            self._fail(case, f"no reply in {timeout_s}s")
            self.sock.close(linger=0)
            self.sock = self._socket()
            return self._tally(case, "no_reply")
        elapsed_s = time.monotonic() - t0
        self.slowest_s = max(self.slowest_s, elapsed_s)
        reply = self.sock.recv_multipart()
        outcome = self._check(case, reply)
        # Exactly one reply: anything more already queued is a second reply.
        if self.sock.poll(0, zmq.POLLIN):
            self._fail(case, "more than one reply")
            while self.sock.poll(50, zmq.POLLIN):
                self.sock.recv_multipart()
        return self._tally(case, outcome)

    def _tally(self, case: FuzzCase, outcome: str) -> str:
        self.replies[outcome] += 1
        self.by_category.setdefault(case.category, Counter())[outcome] += 1
        return outcome

    def _check(self, case: FuzzCase, reply: Sequence[bytes]) -> str:
        try:
            header = msgpack.unpackb(reply[0], raw=False)
        except Exception as exc:
            self._fail(case, f"undecodable reply: {exc}")
            return "bad_reply"
        if not isinstance(header, dict) or header.get("v") != 1 or not isinstance(header.get("ok"), bool):
            self._fail(case, f"not a v1 reply: {header!r:.200}")
            return "bad_reply"
        want_id = expected_reply_id(case.frames[0]) if len(case.frames[0]) <= MAX_HEADER_BYTES else 0
        if header.get("id") != want_id:
            self._fail(case, f"reply id {header.get('id')!r}, expected {want_id}")
        if header["ok"]:
            return "ok"
        err = header.get("error")
        if not isinstance(err, dict) or set(err) != {"code", "name", "message"} or not isinstance(err["message"], str):
            self._fail(case, f"bad error map: {err!r:.200}")
            return "bad_reply"
        try:
            code = ErrorCode(err["code"])
        except ValueError:
            self._fail(case, f"unknown error code {err['code']!r}")
            return "bad_reply"
        if err["name"] != code.name:
            self._fail(case, f"error name {err['name']!r} for code {code.value}")
        if code is ErrorCode.INTERNAL:
            self._fail(case, f"INTERNAL: {err['message'][:300]}")
        return code.name

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


# ---- the victim and a whole campaign --------------------------------------------


@dataclass
class Victim:
    """Blocks stored before fuzzing, through the inline and shm planes, that must survive it.

    ``store()`` fills the victim pool through both planes (enough to reach the
    CPU tier) and pins one chain; ``verify()`` restores every block through
    both planes and returns the blocks that did not come back byte-exact.
    The victim's pool is sized so nothing it stores is ever evicted.
    """

    client: Client
    block_bytes: int
    chains: list[list[bytes]] = field(default_factory=list)

    def store(self, num_chains: int, chain_blocks: int) -> None:
        from tests.stress.stresslib import block_content, chain_content, chain_hashes

        arena = self.client.open_arena(chain_blocks)
        for i in range(num_chains):
            hashes = chain_hashes(f"victim-{i}", chain_blocks)
            if i % 2:
                for slot, h in enumerate(hashes):
                    arena.slot_view(slot)[:] = block_content(h, self.block_bytes)
                self.client.store(hashes, slots=list(range(chain_blocks)))
            else:
                self.client.store(hashes, chain_content(hashes, self.block_bytes))
            self.chains.append(hashes)
        self.client.pin(self.chains[0])

    def verify(self) -> list[str]:
        from tests.stress.stresslib import block_content, chain_content

        bad: list[str] = []
        arena = self.client.arena
        assert arena is not None
        for i, hashes in enumerate(self.chains):
            got = self.client.restore(hashes)
            if len(got) != len(hashes) or bytes(got.data or b"") != chain_content(hashes, self.block_bytes):
                bad.append(f"chain {i} inline: {len(got)}/{len(hashes)} blocks, bytes differ")
            for slot in range(len(hashes)):
                arena.slot_view(slot)[:] = b"\0" * self.block_bytes
            got = self.client.restore(hashes, slots=list(reversed(range(len(hashes)))))
            for j, h in enumerate(hashes[: len(got)]):
                if bytes(arena.slot_view(len(hashes) - 1 - j)) != block_content(h, self.block_bytes):
                    bad.append(f"chain {i} block {j} shm: bytes differ")
            if len(got) != len(hashes):
                bad.append(f"chain {i} shm: {len(got)}/{len(hashes)} blocks")
        return bad


def error_counts(stats: dict[str, Any]) -> Counter[str]:
    """The daemon's errors_total by error name, from a ``stats`` reply."""
    raw = stats["daemon"].get("errors_total", {})
    return Counter({k.split("=", 1)[1]: int(v) for k, v in raw.items()})


def run_campaign(world: FuzzWorld, judge: Judge, num_cases: int, seed: int, *, refresh_every: int = 50,
                 progress_every: int = 0, until_s: float | None = None) -> float:
    """Send ``num_cases`` generated cases (all categories, seeded), stopping early at monotonic
    time ``until_s`` if given; returns the seconds it took."""
    gen = FrameGen(random.Random(seed), world)
    t0 = time.monotonic()
    for i in range(num_cases):
        if until_s is not None and time.monotonic() >= until_s:
            break
        if i and i % refresh_every == 0:
            world.refresh()
        judge.send(gen.next(CATEGORIES[i % len(CATEGORIES)] if i < len(CATEGORIES) else None))
        if progress_every and i and i % progress_every == 0:
            rate = i / (time.monotonic() - t0)
            print(f"  {i} cases, {rate:.0f}/s, failures {judge.num_failures}", flush=True)
    return time.monotonic() - t0


VICTIM_KEYS = ("stores", "cpu_used_blocks", "pinned_blocks", "cpu_evictions")


def victim_snapshot(victim: Victim) -> tuple[Counter[str], dict[str, int]]:
    """What ``after_checks`` compares against: error counters (less what the harness's
    clients saw so far) and the victim pool's counters."""
    stats = victim.client.stats()
    pool = stats["pools"][victim.client.pool]
    return error_counts(stats) - HARNESS_ERRORS, {k: int(pool[k]) for k in VICTIM_KEYS}


def after_checks(victim: Victim, judge: Judge, errors_before: Counter[str], pool_before: dict[str, int],
                 daemon_log: str) -> list[str]:
    """Everything that must hold once fuzzing is over; returns the problems found (empty: all good).

    The daemon answers health; its errors_total grew by exactly the
    rejections the judge saw plus the error replies the harness's own
    clients got (``HARNESS_ERRORS``), code by code; no INTERNAL error; no reply dropped; no traceback in its
    log; the victim pool's counters are unchanged and every victim block
    restores byte-exact through both planes.
    """
    problems: list[str] = []
    c = victim.client
    if c.health().get("status") != "ok":
        problems.append("health is not ok")
    stats = c.stats()
    delta = error_counts(stats) - HARNESS_ERRORS - errors_before
    seen = Counter({k: v for k, v in judge.replies.items() if k not in ("ok", "no_reply")})
    for name in set(seen) | set(delta):
        if delta[name] != seen[name]:
            problems.append(f"errors_total[{name}] grew by {delta[name]} (less the harness's own), "
                            f"the fuzzer saw {seen[name]}")
    if delta["INTERNAL"]:
        problems.append(f"{delta['INTERNAL']} INTERNAL errors")
    dropped = stats["daemon"].get("replies_dropped_total", {})  # by reason
    if sum(dropped.values()):
        problems.append(f"{dropped} replies dropped")
    pool = stats["pools"][c.pool]
    now = {k: int(pool[k]) for k in VICTIM_KEYS}
    if now != pool_before:
        problems.append(f"victim pool counters changed: {pool_before} -> {now}")
    problems += victim.verify()
    if "Traceback" in daemon_log:
        problems.append("the daemon logged a traceback")
    return problems
