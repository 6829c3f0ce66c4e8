"""Real Redis servers for tests and benchmarks: standalone and a 3-node Cluster on loopback.

Used by the remote-tier tests (tests/tiers, tests/daemon) and the
benchmarks (bench/remote.py, bench/protocol*), so it imports no pytest.
Needs the ``remote`` extra (redis-py) and Debian's ``redis-server`` and
``redis-cli`` on PATH: ``apt-get install -y redis-server redis-tools``.

``secret_file(path)`` writes a fresh remote tier secret for kvtierd's
``remote_secret_key_file`` (daemons that share a server share one);
``SECRET`` is a fixed one for ``RemoteTier(..., secret=SECRET)`` in-process.

Every server binds 127.0.0.1 only, keeps nothing on disk (``--save ''
--appendonly no``) and dies with its owner: ``stop()`` kills the process by
its own pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from kvtier.tiers.remote.secret import write_secret

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
MISSING_REASON = (
    "redis-server / redis-cli not installed (Debian: apt-get install -y redis-server redis-tools)"
)


SECRET = bytes(range(32))  # tests and benchmarks only: a deployment makes its own (kvtier keygen --remote-secret)


def secret_file(path: Path) -> Path:
    """A new remote tier secret in a new file ``path`` (mode 0600), for kvtierd's ``remote_secret_key_file``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_secret(path)


def have_redis() -> bool:
    """Both binaries are on PATH (the tests skip, the benchmarks say so, when not)."""
    return REDIS_SERVER is not None and REDIS_CLI is not None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A free loopback port (and its +10000 cluster bus port when asked)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if cluster_bus and (port > 55000 or not _port_free(port + 10000)):
            continue
        return port
    raise RuntimeError("no free loopback port found")


class RedisServer:
    """One redis-server subprocess on 127.0.0.1:port."""

    def __init__(self, workdir: Path, port: int | None = None, *, cluster: bool = False,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.port = port if port is not None else free_port(cluster_bus=cluster)
        self.cluster = cluster
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 5.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [REDIS_SERVER or "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--protected-mode", "yes", "--loglevel", "warning"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf"),
                     "--cluster-node-timeout", "1000"]
        args += list(self.extra_args)
        log = open(self.workdir / "redis.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.exceptions.RedisError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited: "
                                   f"{(self.workdir / 'redis.log').read_text(errors='replace')[-2000:]}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s}s")
            time.sleep(0.02)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2.0, socket_connect_timeout=1.0)

    def kill(self) -> None:
        """SIGKILL (a crash): nothing is flushed, the port is freed."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process must run to die cleanly
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server accepts nothing and answers nothing (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.kill()


class RedisClusterProcs:
    """Three primaries, no replicas, created with ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, size: int = 3) -> None:
        self.servers = [RedisServer(workdir / f"node{i}", cluster=True) for i in range(size)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self, timeout_s: float = 20.0) -> RedisClusterProcs:
        for s in self.servers:
            s.start()
        subprocess.run(
            [REDIS_CLI or "redis-cli", "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in self.servers],
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=timeout_s,
        )
        self.wait_ok(timeout_s)
        return self

    def wait_ok(self, timeout_s: float) -> None:
        """Until every node says cluster_state:ok and knows every other node."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                infos = [s.client().cluster("info") for s in self.servers]
                if all(i.get("cluster_state") == "ok" and int(i.get("cluster_known_nodes", 0)) == len(self.servers)
                       for i in infos):
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(f"cluster not ok within {timeout_s}s")
            time.sleep(0.05)

    def node_id(self, server: RedisServer) -> str:
        return server.client().execute_command("CLUSTER MYID").decode()

    def reshard(self, src: RedisServer, dst: RedisServer, slots: int, timeout_s: float = 30.0) -> None:
        """Move ``slots`` slots (and their keys, with MIGRATE) from src to dst."""
        subprocess.run(
            [REDIS_CLI or "redis-cli", "--cluster", "reshard", f"127.0.0.1:{src.port}",
             "--cluster-from", self.node_id(src), "--cluster-to", self.node_id(dst),
             "--cluster-slots", str(slots), "--cluster-yes"],
            check=True, capture_output=True, timeout=timeout_s,
        )

    def stop(self) -> None:
        for s in self.servers:
            s.kill()
