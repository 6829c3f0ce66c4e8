"""kvtierd really running as another user serves the shared-memory planes (issue 15).

The documented multi-user set-up (docs/operating.md, "users and groups";
systemd/kvtierd@.service with ``User=kvtier Group=kvtier``): the daemon is
its own user, its socket directory is the daemon's (mode 0750, the group's
to traverse), the socket is 0660 and group kvtier, and engines of other
users in that group give their arena and /dev/shm KV files the socket's
group, mode 0660. Here the daemon starts as root and drops to uid 65534 in
its own process (``kvtier.testing.other_uid``: the venv's interpreter lives
under /root, 0700, so another user could not exec it); the test process,
root, is the engine. Root opens any file, so only the daemon's side (uid
65534, gid ``GROUP``) decides what is refused, as in production.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client.client import Client, DaemonError, PoolLayout, probe_health
from kvtier.client.protocol import ErrorCode
from kvtier.client.shm_arena import SHM_DIR, ShmArena
from kvtier.client.shm_orphans import remove_orphaned_arenas
from kvtier.testing.daemon import KvtierDaemon, daemon_available
from kvtier.testing.other_uid import late_import_failures, other_uid_command

DAEMON_UID = 65534  # nobody: exists everywhere, owns nothing of ours
GROUP = 54321  # the "kvtier" group; setgroups takes a number without an /etc/group entry
BLOCK_BYTES = 4096
LEASE_S = 2.0  # short, so that the crashed-client test waits for one expiry only briefly
MIN_SHM_FREE_BYTES = 16 << 20  # arenas and KV files of this module take well under 1 MiB


def layout() -> PoolLayout:
    return PoolLayout(model="m", block_size=4, block_bytes=BLOCK_BYTES, dtype="bfloat16", num_layers=2,
                      kv_heads=2, head_dim=64, mode="store")


def free_tcp_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick; taken by someone else in between is unlikely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shm_unusable_reason() -> str | None:
    """Why /dev/shm cannot hold this module's files, or None when it can."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        return f"{SHM_DIR} is unusable: {exc.strerror}"
    if not os.access(SHM_DIR, os.W_OK | os.X_OK):
        return f"{SHM_DIR} is not writable here"
    if st.f_bavail * st.f_frsize < MIN_SHM_FREE_BYTES:
        return f"{SHM_DIR} has less than {MIN_SHM_FREE_BYTES} bytes free"
    return None


def uid_change_refused_reason() -> str | None:
    """Why this root may not become ``DAEMON_UID`` (a container without CAP_SETUID/CAP_SETGID), or None."""
    drop = f"import os; os.setgroups([{GROUP}]); os.setgid({GROUP}); os.setuid({DAEMON_UID})"
    proc = subprocess.run([sys.executable, "-c", drop], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return f"root here may not change uid: {proc.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.fixture(scope="module")
def daemon() -> Iterator[KvtierDaemon]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the daemon starts as root to drop to another uid, and only root can do that")
    reason = uid_change_refused_reason()
    if reason is not None:
        pytest.skip(reason)
    reason = shm_unusable_reason()
    if reason is not None:
        pytest.skip(reason)
    if not daemon_available():
        pytest.skip("kvtierd does not import here")
    # Under /tmp (1777), not pytest's tmp_path: /tmp/pytest-of-root is 0700,
    # which the daemon's user could not traverse to reach its own socket.
    workdir = Path(tempfile.mkdtemp(prefix="kvtierd-other-uid-"))
    # As systemd's RuntimeDirectory= with User=/Group= and
    # RuntimeDirectoryMode=0750 makes /run/kvtier-N: the daemon's own (or
    # check_socket_dir refuses it), its group may traverse to the socket.
    os.chown(workdir, DAEMON_UID, GROUP)
    d = KvtierDaemon(workdir, dir_mode=0o750, cwd=workdir, command=other_uid_command(DAEMON_UID, GROUP),
                     flags={"log_level": "debug", "socket_mode": "0660", "device": "cpu", "lease_s": LEASE_S,
                            "gpu_bytes": 16 * BLOCK_BYTES, "cpu_bytes": 64 * BLOCK_BYTES,
                            # the exporter's thread and its lazy imports run as the other user too
                            "metrics_port": free_tcp_port()})
    try:
        d.spawn()
        yield d
    finally:
        d.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


def still_serving(daemon: KvtierDaemon, pool: str) -> None:
    """A fresh client of ``pool`` stores and restores inline: the daemon goes on serving."""
    assert daemon.alive, daemon.log_tail(60)
    rng = random.Random(pool)
    with Client(daemon.endpoint, pool, layout()) as c:
        hs, data = [rng.randbytes(16) for _ in range(2)], rng.randbytes(2 * BLOCK_BYTES)
        assert c.store(hs, data) == (2, 0)
        assert bytes(c.restore(hs).data) == data


def test_the_daemon_runs_as_another_uid_behind_a_group_socket(daemon: KvtierDaemon) -> None:
    health = probe_health(daemon.endpoint)
    assert health["pid"] == daemon.pid  # the launcher's own process serves, not a child of it
    status = Path(f"/proc/{health['pid']}/status").read_text()
    ids = {line.split(":")[0]: line.split()[1:] for line in status.splitlines()
           if line.startswith(("Uid:", "Gid:", "Groups:"))}
    # real, effective, saved and filesystem ids: no way back to root
    assert ids["Uid"] == [str(DAEMON_UID)] * 4
    assert ids["Gid"] == [str(GROUP)] * 4
    assert ids["Groups"] == [str(GROUP)]
    # What engines of the group connect through (docs/operating.md): the
    # daemon's file, the daemon's group (its primary gid, as Group=kvtier), 0660.
    st = os.stat(daemon.socket_file)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (DAEMON_UID, GROUP, 0o660)


def test_the_metrics_exporter_serves_as_the_other_user(daemon: KvtierDaemon) -> None:
    import urllib.request

    port = int(daemon.kvtierd_args[daemon.kvtierd_args.index("--metrics-port") + 1])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert "kvtier" in text and "process_" in text  # kvtier's gauges, and the process collector reading /proc


def test_the_arena_plane_stores_and_restores_byte_exact(daemon: KvtierDaemon) -> None:
    rng = random.Random(1)
    hs = [rng.randbytes(16) for _ in range(4)]
    blocks = [rng.randbytes(BLOCK_BYTES) for _ in range(4)]
    with Client(daemon.endpoint, "arena", layout()) as c:
        arena = c.open_arena(8)
        st = os.stat(SHM_DIR / arena.name)
        # The client gave its file to the daemon's group; the daemon opened it (attach_arena succeeded).
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, GROUP, 0o660)
        for slot, block in enumerate(blocks):
            arena.slot_view(slot)[:] = block
        assert c.store(hs, slots=[0, 1, 2, 3]) == (4, 0)
        for slot in range(8):
            arena.slot_view(slot)[:] = bytes(BLOCK_BYTES)  # so what comes back can only be the daemon's copy
        assert list(c.restore(hs, slots=[7, 6, 5, 4]).tiers) == ["gpu"] * 4
        assert [bytes(arena.slot_view(slot)) for slot in (7, 6, 5, 4)] == blocks
        # The daemon read the arena (not the inline frames): its own copy matches too.
        assert bytes(c.restore(hs).data) == b"".join(blocks)


@pytest.mark.parametrize("how", ["allocate_shared_kv", "share_kv_in_place"])
def test_a_registered_dev_shm_kv_file_stores_and_restores_byte_exact(daemon: KvtierDaemon, how: str) -> None:
    import torch

    from kvtier.client import kv_share

    rng = random.Random(how)
    shape = (8, BLOCK_BYTES // 2)  # 8 blocks of float16 along dim 0
    if how == "allocate_shared_kv":
        kv, handle = kv_share.allocate_shared_kv(shape, torch.float16, 0)
        names = [handle["name"]]
    else:
        kv = torch.zeros(shape, dtype=torch.float16)  # an engine's private memory, moved to /dev/shm in place
        names = kv_share.share_kv_in_place([kv])
    hs = [rng.randbytes(16) for _ in range(4)]
    blocks = [rng.randbytes(BLOCK_BYTES) for _ in range(4)]
    raw = kv.view(torch.uint8).view(8, BLOCK_BYTES)  # byte view of the same memory
    try:
        with Client(daemon.endpoint, f"kv-{how}", layout()) as c:
            assert c.register_kv("kv", [kv], 0) == 8
            for name in names:
                st = os.stat(SHM_DIR / name)
                assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (GROUP, 0o660)
            for i, block in enumerate(blocks):
                raw[i] = torch.frombuffer(bytearray(block), dtype=torch.uint8)
            assert c.store(hs, slots=[0, 1, 2, 3], reg="kv") == (4, 0)
            raw.zero_()  # what comes back can only be the daemon's copy
            assert list(c.restore(hs, slots=[4, 5, 6, 7], reg="kv").tiers) == ["gpu"] * 4
            assert [raw[i].numpy().tobytes() for i in (4, 5, 6, 7)] == blocks
            assert bytes(c.restore(hs).data) == b"".join(blocks)
    finally:
        for name in names:
            ShmArena.unlink_name(name)


def test_a_0600_file_is_access_denied_clearly_and_the_daemon_keeps_serving(daemon: KvtierDaemon) -> None:
    import torch

    from kvtier.client import data_planes, kv_share

    # Made here and never given to the daemon's group: an old client, or an
    # engine user outside the group. Mode 0600, owner root.
    arena = ShmArena.create(2, BLOCK_BYTES)
    kv, handle = kv_share.allocate_shared_kv((8, BLOCK_BYTES // 2), torch.float16, 0)
    try:
        for name in (arena.name, handle["name"]):
            st = os.stat(SHM_DIR / name)
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)
        with Client(daemon.endpoint, "denied", layout()) as c:
            # The raw verbs: Client.open_arena / register_kv would share the files first.
            with pytest.raises(DaemonError) as err:
                c._call("attach_arena", {"name": arena.name, "num_slots": 2, "slot_bytes": BLOCK_BYTES})
            assert err.value.code == ErrorCode.ACCESS_DENIED
            message = str(err.value)
            for part in (f"uid {DAEMON_UID}", f"gid {GROUP}", arena.name, "mode 0600", "owner uid 0", "group gid 0",
                         "daemon's group, mode 0660"):
                assert part in message, message
            with pytest.raises(DaemonError) as err:
                c._call("register_kv", {"name": "old", "tensors": data_planes.kv_tensor_fields([kv], 0)})
            assert err.value.code == ErrorCode.ACCESS_DENIED
            message = str(err.value)
            for part in (handle["name"], "mode 0600", "owner uid 0", "group gid 0"):
                assert part in message, message
            # The refusals ended nothing: this session and everyone else go on.
            hs, data = [b"s" * 16], random.Random(3).randbytes(BLOCK_BYTES)
            assert c.store(hs, data) == (1, 0)
            assert bytes(c.restore(hs).data) == data
        still_serving(daemon, "after-denied")
        assert probe_health(daemon.endpoint)["pid"] == daemon.pid
    finally:
        arena.close()
        arena.unlink()
        kv_share.unlink_shared_kv(handle)


# Found by this module (issue 15): /dev/shm is sticky (1777), so only a file's
# owner (the engine's user) or root may unlink it; a daemon of another user gets
# EPERM. That used to escape from the session's release (the pool kept the ended
# session forever); now the release goes on and the file is left to its owner.


def pool_sessions(daemon: KvtierDaemon, pool: str) -> int:
    return int(daemon.stats()["pools"][pool]["sessions"])


def test_a_session_with_an_arena_ends_without_error(daemon: KvtierDaemon) -> None:
    with Client(daemon.endpoint, "arena-bye", layout()) as c:
        arena = c.open_arena(2)
        sid = c.sid
        path = arena.path
    # A pool with a session is never idle: neither pool_idle_ttl_s nor memory
    # pressure would ever free its CPU tier, and it counts against max_pools.
    assert pool_sessions(daemon, "arena-bye") == 0
    assert f"releasing session {sid} failed" not in daemon.log()
    assert not path.exists()  # the client, its owner, removed it at close


def test_a_crashed_clients_arena_is_released_and_left_to_its_owner(daemon: KvtierDaemon) -> None:
    # An engine that dies without bye (os._exit: no atexit, no close).
    engine = (
        "import os, sys\n"
        "from kvtier.client.client import Client, PoolLayout\n"
        f"c = Client({daemon.endpoint!r}, 'crashed', PoolLayout(model='m', block_size=4, "
        f"block_bytes={BLOCK_BYTES}, dtype='bfloat16', num_layers=2, kv_heads=2, head_dim=64, mode='store'))\n"
        "print(c.open_arena(2).name, flush=True)\n"
        "os._exit(0)\n"
    )
    name = subprocess.run([sys.executable, "-c", engine], capture_output=True, text=True, timeout=120,
                          check=True).stdout.strip()
    path = SHM_DIR / name
    try:
        # Until the lease ran out and the session ended (no other session is open now).
        deadline_s = time.monotonic() + LEASE_S + 5.0
        while daemon.stats()["sessions"] and time.monotonic() < deadline_s:
            time.sleep(0.1)
        assert pool_sessions(daemon, "crashed") == 0
        # The daemon unmapped it and says why the name stays (docs/operating.md).
        assert f"arena file {name} is another user's in sticky" in daemon.log()
        assert path.exists()
        # Its user's next arena removes it (client/shm_orphans.py; a minute later, not at once).
        assert name in remove_orphaned_arenas(min_age_s=0.0, name_prefix=name.rsplit("-", 1)[0])  # its own: xdist
        assert not path.exists()
    finally:
        ShmArena.unlink_name(name)  # its user (here root) may


def test_it_stops_cleanly_and_never_missed_a_module_as_the_other_user(daemon: KvtierDaemon) -> None:
    # Last in the module: the drain at SIGTERM may import too.
    assert daemon.stop() == 0, daemon.log_tail(60)
    log = daemon.log()

    def importable_by_root(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package that does not import either
            return False

    # A module root can import but the dropped daemon could not: a lazy
    # import under /root (0700) that kvtier.testing.other_uid does not preload.
    missed = sorted({name for name in late_import_failures(log) if importable_by_root(name)})
    assert not missed, f"imported after the privilege drop, unreachable there: {missed}\n{daemon.log_tail(60)}"
    # Any traceback is a failure as the other user that no assertion above caught.
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert not errors, daemon.log_tail(80)
