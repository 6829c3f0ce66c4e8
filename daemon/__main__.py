"""kvtierd: the daemon's entry point (``kvtierd`` / ``python -m kvtier.daemon``).

Contract: ``main(argv) -> int``. Installs the stop-signal flag first (before
any import that takes time: this module imports only the standard library
and ``lifecycle`` at its top, so that a SIGTERM or SIGINT at any point of
the start-up is a clean stop, exit 0, not death by the default disposition),
loads the configuration (defaults < TOML < ``KVTIER_*`` < flags; a bad value
prints the key and exits 2), sets up logging to stderr, and runs the server
in the foreground until SIGTERM/SIGINT; returns 0 after a clean drain, or
when stopped before it served (the start-up checks the flag between its
slow steps), 1 when the daemon cannot start (socket taken, device missing).

The listening socket: inherited from the predecessor that started this
process (``KVTIER_HANDOVER_FDS``: a zero-downtime upgrade,
``kvtier.daemon.process.handover``), else from systemd (socket activation:
``LISTEN_FDS``), else bound here once no live daemon answers on it
(``lifecycle.refuse_if_served``). SIGUSR2 later starts a successor with
this very command line (``sys.orig_argv``).

This is the composition root: the only place that turns configuration into
the objects the server uses.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.daemon.process.lifecycle import StopFlag

# Everything else is imported inside main(), after the stop flag is installed.
if TYPE_CHECKING:
    from kvtier.daemon.config import DaemonConfig
    from kvtier.daemon.process.handover import Successor
    from kvtier.daemon.process.standby import StandbyWait
    from kvtier.daemon.telemetry.prometheus import StatsSnapshot
    from kvtier.daemon.process.listener import Listener
    from kvtier.daemon.access.security import CurveOptions
    from kvtier.daemon.server import ServeOptions
    from kvtier.daemon.clients.sessions import Closeable
    from kvtier.tiers.persistent_arena import ArenaDirectory

log = logging.getLogger("kvtier.daemon")


def _setup_logging(level: str) -> None:
    # Under systemd, journald stamps every line itself.
    stamp = "" if os.environ.get("JOURNAL_STREAM") else "%(asctime)s "
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format=stamp + "%(levelname)s %(name)s: %(message)s")


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device} configured but CUDA is not available")
    return device


def _import_kv_tensor(desc: dict[str, Any]) -> tuple[Any, Closeable]:
    from kvtier.daemon.shared_memory import kv_import

    return kv_import.import_tensor(desc)


def curve_from_config(cfg: DaemonConfig) -> CurveOptions | None:
    """The CURVE server settings, or None; a bad key file is a config error (exit 2)."""
    from kvtier.daemon.config import ConfigError, exit_on_config_error
    from kvtier.daemon.access.security import ClientKeys, CurveOptions, load_server_key

    if cfg.curve_secret_key_file is None or not cfg.is_tcp:
        # ipc:// is guarded by the socket file's mode (socket_mode); CURVE is
        # for what the network can reach.
        return None
    try:
        public, secret = load_server_key(cfg.curve_secret_key_file)
    except (OSError, ValueError) as exc:
        exit_on_config_error(ConfigError("curve_secret_key_file", str(exc)))
    tenant_by_key = {t.public_key: name for name, t in cfg.tenants.items() if t.public_key}
    return CurveOptions(public, secret, ClientKeys(cfg.curve_public_keys_dir, tenant_by_key))


def remote_secret_from_config(cfg: DaemonConfig) -> bytes | None:
    """The remote tier's secret, or None without a remote tier; a bad file or missing library exits 2."""
    from kvtier.daemon.config import ConfigError, exit_on_config_error

    if not cfg.remote_url_keys:
        return None
    try:
        import blake3  # noqa: F401 - the values' MAC
        import redis  # noqa: F401
    except ImportError as exc:
        exit_on_config_error(ConfigError(cfg.remote_url_keys[0], f"the remote tier needs {exc.name}: "
                                         "pip install 'kvtier[remote]'"))
    from kvtier.tiers.remote.secret import load_secret

    assert cfg.remote_secret_key_file is not None  # the configuration requires it with a remote tier
    try:
        return load_secret(cfg.remote_secret_key_file)
    except (OSError, ValueError) as exc:
        exit_on_config_error(ConfigError("remote_secret_key_file", str(exc)))


def options_from_config(cfg: DaemonConfig, device: str, *,
                        curve: CurveOptions | None = None, remote_secret: bytes | None = None,
                        arenas: ArenaDirectory | None = None, listener: Listener | None = None,
                        successor: Successor | None = None, standby_of: StandbyWait | None = None,
                        reusable_bytes: int = 0) -> ServeOptions:
    import psutil

    from kvtier.daemon.config import PoolSettings, resolve_cpu_budget_bytes
    from kvtier.daemon.server import ServeOptions
    from kvtier.daemon.tenancy.tenants import TenantRegistry

    on_cuda = device.startswith("cuda")

    def sizing_for(name: str, reusable_bytes: int = 0) -> PoolSettings:
        # Memory the pool's persistent CPU tier already holds counts as available: an "auto" or N%
        # cpu_bytes comes to what it came to before the restart, not less.
        available = int(psutil.virtual_memory().available) + reusable_bytes
        return cfg.pool_settings(name).sized(on_cuda=on_cuda, available_bytes=available)

    return ServeOptions(
        endpoint=cfg.socket,
        device=device,
        sizing_for=sizing_for,
        remote_secret=remote_secret,
        lease_s=cfg.lease_s,
        heartbeat_s=cfg.heartbeat_s,
        poll_interval_s=cfg.poll_interval_s,
        drain_timeout_s=cfg.drain_timeout_s,
        max_payload_bytes=cfg.max_message_bytes,
        max_shm_files_per_session=cfg.max_shm_files_per_session,
        max_registrations_per_session=cfg.max_registrations_per_session,
        lend_lease_s=cfg.lend_lease_s,
        max_pinned_share=cfg.max_pinned_share,
        cpu_budget_bytes=resolve_cpu_budget_bytes(cfg, int(psutil.virtual_memory().available) + reusable_bytes),
        pool_idle_ttl_s=cfg.pool_idle_ttl_s,
        max_unread_reply_bytes=cfg.max_unread_reply_bytes,
        max_unread_reply_bytes_total=cfg.max_unread_reply_bytes_total,
        max_pools=cfg.max_pools,
        max_sessions=cfg.max_sessions,
        max_auth_failures_per_minute=cfg.max_auth_failures_per_minute,
        max_connections=cfg.max_connections,
        max_connections_per_peer=cfg.max_connections_per_peer,
        hash_algo=cfg.hash_algo,
        socket_mode=cfg.socket_mode,
        curve=curve,
        tenants=TenantRegistry(cfg.tenants),
        arenas=arenas,
        listener=listener,
        successor=successor,
        standby_of=standby_of,
        standby=cfg.standby,
        upgrade_argv=tuple(sys.orig_argv),
        upgrade_timeout_s=cfg.upgrade_timeout_s,
        start_metrics=_metrics_starter(cfg),
    )


def _metrics_starter(cfg: DaemonConfig) -> Callable[[StatsSnapshot], Closeable] | None:
    """The Prometheus endpoint's start, for the server to call once it serves (None without metrics_port)."""
    if cfg.metrics_port is None:
        return None
    from kvtier.daemon.telemetry.metrics_endpoint import start_exporter

    host, port = cfg.metrics_host, cfg.metrics_port
    return lambda snapshot: start_exporter(host, port, snapshot)


def _arena_directory(cfg: DaemonConfig, *, standby: bool = False) -> ArenaDirectory | None:
    """Where the persistent CPU tiers live (None: persistence off); a missing directory is a config error.
    ``standby``: the live primary owns them; listed (and tidied) only when this daemon takes over."""
    if not cfg.persist_cpu_tier:
        return None
    from kvtier.daemon.config import ConfigError, exit_on_config_error
    from kvtier.tiers.arena_files import list_arenas
    from kvtier.tiers.persistent_arena import ArenaDirectory
    from kvtier.tiers.units import format_gib

    if not cfg.arena_dir.is_dir() or not os.access(cfg.arena_dir, os.W_OK | os.X_OK):
        exit_on_config_error(ConfigError("arena_dir", f"{cfg.arena_dir} is not a directory this user can write; "
                                         "create it, choose another, or set persist_cpu_tier = false"))
    arenas = ArenaDirectory(cfg.arena_dir, cfg.socket)
    if standby:
        return arenas
    mine = arenas.instance_arenas()
    if mine:
        log.info("%d persistent CPU tiers from before this start (%s) in %s: adopting them", len(mine),
                 format_gib(sum(a.memory_bytes for a in mine)), cfg.arena_dir)
    stems = {a.stem for a in mine}
    others = [a for a in list_arenas(cfg.arena_dir, uid=arenas.uid) if a.stem not in stems and not a.held]
    if others:
        log.warning("%s holds %d CPU tiers (%s) of other kvtierd instances that no running daemon holds; "
                    "'kvtier arenas' lists them, 'kvtier arenas remove' frees them", cfg.arena_dir, len(others),
                    format_gib(sum(a.memory_bytes for a in others)))
    return arenas


def _keep_large_buffers_mapped() -> None:
    """Stop glibc from mapping (and page-faulting) every large buffer afresh.

    Inline restores stage up to max_message_bytes per request; above glibc's
    mmap threshold each staging buffer is a new mapping, and faulting in 32
    MiB took 14 ms of a 34 ms round trip in bench/protocol.py. Raising the
    threshold keeps freed buffers in the heap for the next request.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 256 * 1024**2)
        libc.mallopt(m_trim_threshold, 512 * 1024**2)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def main(argv: Sequence[str] | None = None) -> int:
    # First: the imports below take seconds on a loaded host, and a SIGTERM
    # meanwhile must be a clean stop (exit 0), not the default disposition's 143.
    stop = StopFlag()
    stop.install()
    import zmq

    from kvtier.daemon.config import ConfigError, exit_on_config_error, load_config_or_exit
    from kvtier.daemon.faults import FAULTS_ENV, parse_faults
    from kvtier.daemon.process.handover import HANDOVER_ENV, Successor
    from kvtier.daemon.process.standby import STANDBY_ENV, StandbyWait
    from kvtier.daemon.process.lifecycle import refuse_if_served
    from kvtier.daemon.process.listener import ListenerMismatch, inherited_listener, systemd_listener
    from kvtier.daemon.process.sd_notify import Notifier

    # KVTIER_TEST_FAULTS is test-only fault injection (kvtier.daemon.faults),
    # and KVTIER_HANDOVER_FDS a predecessor's hand-over (kvtier.daemon.process.handover),
    # not configuration: the config loader would reject them as unknown.
    environ = dict(os.environ)
    faults_spec = environ.pop(FAULTS_ENV, "")
    try:
        successor = Successor.from_environ(environ)
    except RuntimeError as exc:
        exit_on_config_error(ConfigError(HANDOVER_ENV, str(exc)))
    try:
        standby_of = StandbyWait.from_environ(environ)
    except RuntimeError as exc:
        exit_on_config_error(ConfigError(STANDBY_ENV, str(exc)))
    cfg = load_config_or_exit(argv, environ)
    try:
        fault_plan = parse_faults(faults_spec)
    except ValueError as exc:
        exit_on_config_error(ConfigError(FAULTS_ENV, str(exc)))
    curve = curve_from_config(cfg)
    remote_secret = remote_secret_from_config(cfg)
    _setup_logging(cfg.log_level)
    if cfg.curve_secret_key_file is not None and curve is None:
        log.warning("curve_secret_key_file is set but %s is not tcp://: CURVE is not used (the socket file's mode "
                    "%04o decides who connects)", cfg.socket, cfg.socket_mode)
    if len(cfg.tenants) > 1 and cfg.hash_algo != "sha256":
        log.warning("%d tenants share this daemon with hash_algo %s: a tenant can craft colliding hashes within "
                    "its own namespace; sha256 is the default with tenants for that reason", len(cfg.tenants),
                    cfg.hash_algo)
    if curve is None:
        key_only = sorted(name for name, t in cfg.tenants.items() if t.token_sha256 is None)
        if key_only:
            log.warning("tenants %s have a public_key and no token, but CURVE is off on %s: they cannot connect",
                        ", ".join(key_only), cfg.socket)
    if cfg.is_tcp and curve is None:
        log.warning("serving %s WITHOUT authentication or encryption (insecure_tcp): anyone who reaches the port "
                    "can read and overwrite cached KV blocks", cfg.socket)
    _keep_large_buffers_mapped()
    if fault_plan is not None:
        log.warning("TEST-ONLY fault injection is active (%s=%s): copies will fail or stall on purpose",
                    FAULTS_ENV, fault_plan.describe())
    try:
        if _stopped_early(stop):
            return 0
        try:
            if successor is not None:
                listener = inherited_listener(successor.listen_fd, cfg.socket, origin="predecessor", owns_file=False)
                log.info("taking over from kvtierd pid %d: its socket %s, then its CPU tiers", successor.predecessor_pid,
                         cfg.socket)
            elif standby_of is not None:
                listener = inherited_listener(standby_of.listen_fd, cfg.socket, origin="standby", owns_file=False)
                log.info("standby for kvtierd pid %d on %s: starting, then waiting", standby_of.primary_pid, cfg.socket)
            else:
                listener = systemd_listener(cfg.socket, os.environ)
        except ListenerMismatch as exc:
            log.error("cannot serve %s: %s", cfg.socket, exc)
            return 1
        if listener is None:
            refuse_if_served(cfg.socket)
        # torch (through the tiers) takes seconds to import: config errors,
        # --help and a taken socket must not wait for it.
        from kvtier.daemon.config.host import check_gpu_bytes
        from kvtier.daemon.server import Server

        if _stopped_early(stop):
            return 0

        notifier = Notifier.from_environ(predecessor_pid=successor.predecessor_pid if successor
                                         else standby_of.primary_pid if standby_of else None)
        # A standby says nothing to systemd before it serves: the primary is the service's voice.
        startup = Notifier(None) if standby_of is not None else notifier
        startup.status("starting: checking devices and host memory")
        device = _resolve_device(cfg.device)
        try:
            check_gpu_bytes(cfg, device)  # needs the resolved device: "auto" is torch's to answer
        except ConfigError as exc:
            startup.status(f"refused to start: {exc}")
            exit_on_config_error(exc)
        if device.startswith("cuda"):
            from kvtier.tiers.transfer import warm_up

            startup.status(f"starting: CUDA context and copy self-tests on {device}")
            started_s = time.monotonic()
            methods = warm_up(device)
            log.info("%s ready in %.1f s: copy methods %s", device, time.monotonic() - started_s, methods)
        from kvtier.daemon.pooling.memory import check_startup, gib, pins_cpu_tiers
        from kvtier.tiers.host_memory import HostMemoryError

        arenas = _arena_directory(cfg, standby=standby_of is not None)
        reusable_bytes = arenas.memory_bytes(tidy=standby_of is None) if arenas is not None else 0
        try:
            plan = check_startup(cfg, pin=pins_cpu_tiers(), reusable_bytes=reusable_bytes)
        except HostMemoryError as exc:
            startup.status(f"refused to start: {exc}")
            exit_on_config_error(ConfigError("cpu_bytes", str(exc)))
        log.info("CPU tiers planned: %s (allocated when the first hello names each pool)",
                 ", ".join(f"{key} = {gib(n)}" for key, n in plan))
        if _stopped_early(stop):
            return 0
        options = options_from_config(cfg, device, curve=curve, remote_secret=remote_secret, arenas=arenas,
                                      listener=listener, successor=successor, standby_of=standby_of,
                                      reusable_bytes=reusable_bytes)
        if fault_plan is not None:
            options = fault_plan.serve_options(options)  # the test seam: copy engines, no lent restores
        server = Server(options, stop,
                        kv_import=_import_kv_tensor, notifier=notifier)
        return server.run()
    except (RuntimeError, OSError, zmq.ZMQError) as exc:
        log.error("cannot serve: %s", exc)
        return 1


def _stopped_early(stop: StopFlag) -> bool:
    """True (logged) when SIGTERM/SIGINT came during the start-up: nothing is served yet, nothing to drain."""
    if stop.requested:
        log.info("%s during start-up: stopping before serving", stop.signal_name)
    return stop.requested


if __name__ == "__main__":
    sys.exit(main())
