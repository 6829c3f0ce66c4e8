"""What one client can do to the daemon is bounded (issue 15): absurd layouts, other sessions'
sids, arenas and registrations, and file descriptors. Each refusal has its own code, and
the daemon goes on serving everyone else."""

from __future__ import annotations

import random
import time

import pytest

from kvtier.client.client import Client, DaemonError, PoolLayout
from kvtier.client.protocol import ErrorCode

BLOCK_BYTES = 4096


def layout(**kw: object) -> PoolLayout:
    base = dict(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=2,
                kv_heads=2, head_dim=64, mode="store")
    base.update(kw)
    return PoolLayout(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def daemon(kvtierd_module_factory):  # type: ignore[no-untyped-def]
    return kvtierd_module_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)


def still_serving(daemon, pool: str) -> None:  # type: ignore[no-untyped-def]
    assert daemon.alive, daemon.log()[-3000:]
    rng = random.Random(pool)
    with Client(daemon.endpoint, pool, layout()) as other:
        hs, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
        assert other.store(hs, data) == (2, 0)
        assert bytes(other.restore(hs).data) == data


@pytest.mark.parametrize("mode", ["store", "engine"])
def test_a_layout_that_gives_the_pool_no_block_is_refused(daemon, mode: str) -> None:  # type: ignore[no-untyped-def]
    from kvtier.client.client import probe_health

    pools_before = probe_health(daemon.endpoint)["pools"]
    for block_bytes in (1 << 40, 64 * BLOCK_BYTES + 1):
        with pytest.raises(DaemonError) as err:
            Client(daemon.endpoint, f"huge-{mode}-{block_bytes}", layout(block_bytes=block_bytes, mode=mode)).close()
        assert err.value.code == ErrorCode.INVALID_FIELD
        assert "no block" in str(err.value) and str(block_bytes) in str(err.value)
    assert probe_health(daemon.endpoint)["pools"] == pools_before  # nothing was created
    still_serving(daemon, f"after-huge-{mode}")


# ---- sessions are bound to their identity (item 7) ------------------------------------------


def _as_other_user(endpoint: str, headers: list[dict[str, object]]) -> list[dict[str, object]]:
    """Send each header from a forked child running as uid 65534 (gid 0, to reach the 0660 socket); their replies."""
    from kvtier.client.protocol import decode, encode

    def send_all(sock):  # type: ignore[no-untyped-def]
        out = []
        for h in headers:
            sock.send(encode(h))
            out.append(decode(sock.recv()) if sock.poll(10_000) else {"timeout": True})
        return out

    return _run_as_other_user(endpoint, send_all)


def _run_as_other_user(endpoint: str, fn):  # type: ignore[no-untyped-def]
    """``fn(dealer socket)`` in a forked child running as uid 65534 (gid 0); its JSON-able result."""
    import json
    import os

    import zmq

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(0)
            os.setuid(65534)
            ctx = zmq.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            out = fn(sock)
            sock.close()
            ctx.term()
            os.write(w, json.dumps(out, default=repr).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b"[]")


@pytest.fixture
def shared_daemon(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A daemon on a 0660 socket in a directory other users may enter."""
    import os
    import tempfile
    from pathlib import Path

    from kvtier.testing.daemon import KvtierDaemon
    from tests.conftest import DEFAULT_FLAGS

    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    root = Path(tempfile.mkdtemp(prefix="kvtier-uid-"))
    root.chmod(0o755)
    # 0755 too: the other user must reach the 0660 socket inside.
    d = KvtierDaemon.start(root / "d", flags={**DEFAULT_FLAGS, "socket_mode": "0660"}, dir_mode=0o755)
    yield d
    d.kill()


def test_a_sid_is_no_use_to_another_user(shared_daemon) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(9)
    hs, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
    with Client(shared_daemon.endpoint, "victim", layout()) as victim:
        victim.store(hs, data)
        victim.pin(hs)
        sid = victim.sid
        ops = [dict(op="unpin", hashes=hs), dict(op="restore", hashes=hs), dict(op="lookup", hashes=hs),
               dict(op="heartbeat"), dict(op="clear"), dict(op="bye")]
        replies = _as_other_user(shared_daemon.endpoint,
                                 [{"v": 1, "id": i + 1, "sid": sid, **op} for i, op in enumerate(ops)]
                                 + [{"v": 1, "id": 99, "op": "health"}])
        assert len(replies) == len(ops) + 1, replies
        for op, reply in zip(ops, replies):
            assert reply.get("ok") is False, (op, reply)
            assert reply["error"]["code"] == int(ErrorCode.FOREIGN_SESSION), (op, reply)
        assert replies[-1]["ok"] is True  # the other user is served, just not as the victim
        # Nothing happened to the victim's session: still there, still pinned, blocks intact.
        assert bytes(victim.restore(hs).data) == data
        assert victim.unpin(hs) == 2
        assert victim.stats()["pools"]["victim"]["sessions"] == 1


# ---- arenas and registrations belong to one session (item 6) --------------------------------


def test_an_arena_or_kv_file_attached_by_one_session_is_refused_to_another(daemon) -> None:  # type: ignore[no-untyped-def]
    import os

    from kvtier.client.kv_share import allocate_shared_kv, export_tensor

    with Client(daemon.endpoint, "own-a", layout()) as a, Client(daemon.endpoint, "own-b", layout()) as b:
        arena = a.open_arena(2)
        with pytest.raises(DaemonError) as err:
            b._call("attach_arena", {"name": arena.name, "num_slots": 2, "slot_bytes": BLOCK_BYTES})
        assert err.value.code == ErrorCode.IN_USE
        kv, _handle = allocate_shared_kv([4, BLOCK_BYTES // 2], "bfloat16", 0)
        a.register_kv("kv", [kv], 0)
        desc = export_tensor(kv)
        with pytest.raises(DaemonError) as err:
            b._call("register_kv", {"name": "stolen", "tensors": [{"desc": desc, "block_dim": 0}]})
        assert err.value.code == ErrorCode.IN_USE
        # B's end unlinks nothing of A's.
        b.close()
        assert os.path.exists(arena.path)
        # Once A's session is gone, the file is free to be taken (a restarted client re-attaches).
        a._call("unregister_kv", {"name": "kv"})
        with Client(daemon.endpoint, "own-c", layout()) as c:
            c._call("register_kv", {"name": "mine-now", "tensors": [{"desc": desc, "block_dim": 0}]})
        del kv
    still_serving(daemon, "own-after")


def test_another_users_file_is_refused(shared_daemon) -> None:  # type: ignore[no-untyped-def]
    from kvtier.client.protocol import decode, encode

    with Client(shared_daemon.endpoint, "root-pool", layout()) as owner:
        arena = owner.open_arena(2)
        lay = dict(layout().to_wire())

        def hijack(sock):  # type: ignore[no-untyped-def]
            sock.send(encode({"v": 1, "op": "hello", "id": 1, "pool": "root-pool", "layout": lay}))
            assert sock.poll(10_000)
            sid = decode(sock.recv())["sid"]
            sock.send(encode({"v": 1, "op": "attach_arena", "id": 2, "sid": sid, "name": arena.name,
                              "num_slots": 2, "slot_bytes": BLOCK_BYTES}))
            assert sock.poll(10_000)
            return [decode(sock.recv())]

        (reply,) = _run_as_other_user(shared_daemon.endpoint, hijack)
        assert reply["ok"] is False and reply["error"]["code"] == int(ErrorCode.NOT_OWNER), reply


# ---- descriptors: registrations and mapped files capped per session (item 2) ---------------


def test_registrations_and_mapped_files_are_capped_per_session(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    from kvtier.client.kv_share import allocate_shared_kv, export_tensor

    d = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES,
                        max_registrations_per_session=3, max_shm_files_per_session=4)
    kv, _handle = allocate_shared_kv([4, BLOCK_BYTES // 2], "bfloat16", 0)
    one = [{"desc": export_tensor(kv), "block_dim": 0}]
    for _round in range(2):  # caps are per session: a new session starts from zero
        with Client(d.endpoint, "caps", layout()) as c:
            for i in range(3):
                c._call("register_kv", {"name": f"r{i}", "tensors": one})
            with pytest.raises(DaemonError) as err:
                c._call("register_kv", {"name": "r3", "tensors": one})
            assert err.value.code == ErrorCode.TOO_MANY_REGISTRATIONS
            c.open_arena(2)  # the fourth file
            c._call("unregister_kv", {"name": "r0"})
            with pytest.raises(DaemonError) as err:
                c._call("register_kv", {"name": "two", "tensors": one * 2})
            assert err.value.code == ErrorCode.TOO_MANY_FILES
            c._call("register_kv", {"name": "r0", "tensors": one})
            with pytest.raises(DaemonError) as err:
                c._call("register_kv", {"name": "r4", "tensors": one})
            assert err.value.code in (ErrorCode.TOO_MANY_FILES, ErrorCode.TOO_MANY_REGISTRATIONS)
            still_serving(d, f"caps-other-{_round}")
    del kv


# ---- pools: at most max_pools (item 3, part) ---------------------------------------------------


def test_a_hello_past_max_pools_is_refused_and_existing_pools_still_join(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    from kvtier.client.client import probe_health

    d = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES, max_pools=3)
    # Pools with sessions are never reclaimed (an idle one would be: test_pool_budget.py).
    holders = [Client(d.endpoint, f"p{i}", layout()) for i in range(3)]
    try:
        with pytest.raises(DaemonError) as err:
            Client(d.endpoint, "p3", layout()).close()
        assert err.value.code == ErrorCode.TOO_MANY_POOLS and "max_pools" in str(err.value)
        assert probe_health(d.endpoint)["pools"] == 3
        rng = random.Random(4)
        with Client(d.endpoint, "p1", layout()) as c:  # joining one that exists is fine
            hs, data = [rng.randbytes(16)], rng.randbytes(BLOCK_BYTES)
            assert c.store(hs, data) == (1, 0)
            assert bytes(c.restore(hs).data) == data
            assert c.stats()["daemon"]["pools_refused_total"] == 1
    finally:
        for h in holders:
            h.close()


# ---- sessions: at most max_sessions (issue 32 item 4) ----------------------------------------------


def test_hellos_past_max_sessions_are_refused_with_their_own_code_and_create_nothing(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    """Sessions were unbounded: 24,915 live sessions cost +90 MB. Now a hello past ``max_sessions`` gets
    TOO_MANY_SESSIONS (before any pool is created for it), and one session ending makes room."""
    import zmq

    from kvtier.client.client import probe_health
    from kvtier.client.protocol import decode, encode

    cap, asked = 50, 1000
    d = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES, max_sessions=cap)
    rss_before_bytes = d.rss_bytes()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(d.endpoint)
    try:
        for i in range(asked):  # pipelined; half of them name a pool of their own
            pool = "held" if i % 2 else f"own{i}"
            sock.send(encode({"v": 1, "op": "hello", "id": i + 1, "pool": pool, "layout": layout().to_wire()}))
        codes: dict[str, int] = {}
        sids = []
        for _ in range(asked):
            assert sock.poll(30_000)
            reply = decode(sock.recv())
            key = "ok" if reply["ok"] else reply["error"]["name"]
            codes[key] = codes.get(key, 0) + 1
            if reply["ok"]:
                sids.append(reply["sid"])
            else:
                assert "max_sessions" in reply["error"]["message"], reply
        assert codes == {"ok": cap, "TOO_MANY_SESSIONS": asked - cap}, codes
        health = probe_health(d.endpoint)
        assert health["sessions"] == cap
        assert health["pools"] == 1 + cap // 2  # "held" and the own pools of the hellos that got a session
        assert d.rss_bytes() - rss_before_bytes < 64 << 20
        with pytest.raises(DaemonError) as err:
            Client(d.endpoint, "held", layout()).close()
        assert err.value.code == ErrorCode.TOO_MANY_SESSIONS
        sock.send(encode({"v": 1, "op": "bye", "id": 9999, "sid": sids[0]}))
        assert sock.poll(10_000) and decode(sock.recv())["ok"]
        with Client(d.endpoint, "held", layout()) as c:  # one ended: room for one
            assert c.stats()["daemon"]["errors_total"]["code=TOO_MANY_SESSIONS"] == asked - cap + 1
    finally:
        sock.close()
        ctx.term()
    still_serving(d, "after-sessions")


def test_an_abstract_socket_without_curve_serves_only_the_daemons_own_user(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import secrets

    from kvtier.testing.daemon import KvtierDaemon

    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another user")
    endpoint = f"ipc://@kvtier-test-{secrets.token_hex(4)}"
    d = KvtierDaemon(tmp_path, endpoint=endpoint, flags={"cpu_bytes": 65536, "gpu_bytes": 16384})
    try:
        d.spawn()
        with Client(endpoint, "mine", layout()) as me:  # the daemon's own user
            assert me.stats()["sessions"] == 1
        hello = {"v": 1, "id": 1, "op": "hello", "pool": "theirs", "layout": layout().to_wire()}
        replies = _as_other_user(endpoint, [hello, {"v": 1, "id": 2, "op": "stats"}, {"v": 1, "id": 3, "op": "health"}])
        assert [r.get("ok") for r in replies] == [False, False, False], replies
        assert {r["error"]["code"] for r in replies} == {int(ErrorCode.UNAUTHORIZED)}
        with Client(endpoint, "mine", layout()) as me:
            assert "theirs" not in me.stats()["pools"]  # the refused hello created nothing
    finally:
        d.kill()


# ---- pins are capped (item 11) ------------------------------------------------------------------


def test_pins_past_the_sessions_share_are_refused_and_pin_nothing(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    # 4 GPU + 12 CPU blocks; max_pinned_share 0.5: a session may pin 8.
    d = kvtierd_factory(gpu_bytes=4 * BLOCK_BYTES, cpu_bytes=12 * BLOCK_BYTES, max_pinned_share=0.5)
    rng = random.Random(4)
    hs = [rng.randbytes(16) for _ in range(12)]
    with Client(d.endpoint, "pins", layout()) as a, Client(d.endpoint, "pins", layout()) as b:
        a.store(hs, rng.randbytes(12 * BLOCK_BYTES))
        assert len(a.pin(hs[:6])) == 6
        with pytest.raises(DaemonError) as err:
            a.lookup(hs[6:9], pin=True)  # 6 + 3 > 8
        assert err.value.code == ErrorCode.TOO_MANY_PINS and "max_pinned_share" in str(err.value)
        with pytest.raises(DaemonError) as err:
            a.pin(hs[6:9])
        assert err.value.code == ErrorCode.TOO_MANY_PINS
        assert a.stats()["pools"]["pins"]["pinned_blocks"] == 6  # the refused calls pinned nothing
        assert len(a.pin(hs[6:8])) == 2  # up to the cap is fine
        assert len(b.pin(hs[8:12])) == 4  # another session of the anonymous tenant has its own share
        a.unpin(hs[:6])
        assert len(a.lookup(hs[8:12], pin=True)) == 4  # room again after unpin
    still_serving(d, "after-pins")


# ---- the shm planes with a daemon of another user (item 8) ---------------------------------------


def test_a_client_gives_its_shm_files_to_the_group_of_a_daemon_running_as_another_user(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    import os
    import stat

    import torch

    from kvtier.client import kv_share
    from kvtier.client.shm_arena import SHM_DIR

    if os.geteuid() != 0:
        pytest.skip("needs root to make the socket look like another user's")
    d = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)
    sock = d.socket_file
    os.chown(sock, 65534, 4242)  # as if kvtierd ran as another user, in group 4242
    try:
        with Client(d.endpoint, "other-user", layout()) as c:
            arena = c.open_arena(4)
            st = os.stat(SHM_DIR / arena.name)
            assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (4242, 0o660)
            kv, handle = kv_share.allocate_shared_kv((8, BLOCK_BYTES // 2), torch.float16, 0)  # 8 blocks
            c.register_kv("kv", [kv], 0)
            st = os.stat(SHM_DIR / handle["name"])
            assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (4242, 0o660)
            c.store([b"g" * 16], slots=[0], reg="kv")  # and the daemon uses them
            assert list(c.lookup([b"g" * 16])) == ["gpu"]
    finally:
        os.chown(sock, 0, 0)


def test_a_file_the_daemon_may_not_open_is_access_denied_with_its_mode(kvtierd_factory) -> None:  # type: ignore[no-untyped-def]
    import fcntl
    import os
    import struct

    from kvtier.client.shm_arena import SHM_DIR, ShmArena

    d = kvtierd_factory(gpu_bytes=16 * BLOCK_BYTES, cpu_bytes=64 * BLOCK_BYTES)
    arena = ShmArena.create(2, BLOCK_BYTES)  # made here, never announced: nobody unlinks it but this test
    name = arena.name
    arena.close()
    path = SHM_DIR / name
    fs_ioc_getflags, fs_ioc_setflags, immutable = 0x80086601, 0x40086602, 0x10
    fd = os.open(path, os.O_RDONLY)
    try:  # an immutable file: nobody, root included, may open it for writing (EPERM)
        flags = struct.unpack("i", fcntl.ioctl(fd, fs_ioc_getflags, struct.pack("i", 0)))[0]
        fcntl.ioctl(fd, fs_ioc_setflags, struct.pack("i", flags | immutable))
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        pytest.skip(f"cannot make a /dev/shm file immutable here: {exc.strerror}")
    try:
        with Client(d.endpoint, "denied", layout()) as again:
            with pytest.raises(DaemonError) as err:
                again._call("attach_arena", {"name": name, "num_slots": 2, "slot_bytes": BLOCK_BYTES})
            assert err.value.code == ErrorCode.ACCESS_DENIED
            assert "mode 0600" in str(err.value) and "group" in str(err.value)
    finally:
        fcntl.ioctl(fd, fs_ioc_setflags, struct.pack("i", flags))
        os.close(fd)
        os.unlink(path)


# ---- replies a client does not read (item 4) ------------------------------------------------------


@pytest.mark.parametrize("held", ["one_run", "scattered"])
def test_a_client_that_does_not_read_its_replies_holds_a_bounded_number_of_bytes(kvtierd_factory, held: str) -> None:  # type: ignore[no-untyped-def]
    """Replies lent in place, and replies whose copies are still running, count against the budget.

    ``one_run``: the 8 blocks lie in one run of host slots, so each restore
    reply lends them in place. ``scattered``: stored between other blocks,
    they are gathered by a copy first, as a CUDA GPU tier's always are (it
    cannot lend device memory); replies waiting for their copies count too.
    """
    import zmq

    from kvtier.client.protocol import decode, encode

    block = 64 * 1024
    limit = 1 << 20
    d = kvtierd_factory(gpu_bytes=16 * block, cpu_bytes=16 * block, max_unread_reply_bytes=limit, device="cpu")
    lay = PoolLayout(model="m", block_size=4, block_bytes=block, dtype="bfloat16", num_layers=1, kv_heads=1,
                     head_dim=8, mode="store")
    hs = [bytes([5, i]) * 8 for i in range(8)]
    with Client(d.endpoint, "unread", lay) as owner:
        if held == "one_run":
            owner.store(hs, bytes(8 * block))
        else:
            for i, h in enumerate(hs):
                owner.store([h, bytes([6, i]) * 8], bytes(2 * block))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 1)  # reads nothing, queues almost nothing
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.endpoint)
        try:
            sock.send(encode({"v": 1, "op": "hello", "id": 1, "pool": "unread", "layout": lay.to_wire()}))
            assert sock.poll(10_000)
            sid = decode(sock.recv())["sid"]
            n = 300  # 512 KiB each: 150 MiB of replies if the daemon held them all
            for i in range(n):
                sock.send(encode({"v": 1, "op": "restore", "id": 10 + i, "sid": sid, "hashes": hs}))
            time.sleep(2.0)
            unsent = owner.stats()["daemon"]["reply_bytes_unsent"]
            assert unsent <= limit + 8 * block, unsent
            codes: dict[str, int] = {}
            deadline = time.monotonic() + 60
            got = 0
            while got < n and time.monotonic() < deadline:
                if not sock.poll(1000):
                    continue
                frames = sock.recv_multipart()
                reply = decode(frames[0])
                got += 1
                key = "ok" if reply["ok"] else reply["error"]["name"]
                codes[key] = codes.get(key, 0) + 1
            assert codes.get("UNREAD_REPLIES", 0) > 0 and codes.get("ok", 0) > 0, codes
        finally:
            sock.close(0)
            ctx.term()
        assert owner.stats()["daemon"]["reply_bytes_unsent"] == 0  # all sent once read
    still_serving(d, "after-unread")
