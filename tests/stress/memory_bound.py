"""What kvtierd's resident memory may grow to, from its configuration: the bound the hostile scenarios check.

Each term is a limit the daemon enforces (docs/operating.md: "Host memory",
"Policy memory", the ``max_*`` keys, "Connection floods") times what one unit
of it costs. The costs per unit are measured on the 2-core VM and rounded up
with room for the allocator; the few fixed allowances are stated with why.
Nothing here looks at what the daemon actually used.

Contract
========

- ``policy_key_bound(policy, cpu_blocks)``: the keys a pool's CPU-tier
  policy may hold, resident blocks included (docs/operating.md, "Policy
  memory"; ``chain``'s allowance for the one request being recorded is
  counted once per daemon by ``rss_bound``, since one loop records one
  request at a time).
- ``PoolSpec(name, policy, gpu_bytes, cpu_bytes, block_bytes, remote)``:
  one pool as configured (``block_bytes`` is what its first hello said).
- ``DaemonSpec``: the daemon-wide limits (``max_sessions``,
  ``max_connections``, the descriptor limit, reply caps, ``max_message_bytes``,
  ``max_pools`` and the default pool's tiers for pools the configuration
  does not name).
- ``rss_bound(start_rss_bytes, daemon, pools, mapped_shm_bytes)``:
  ``{"terms": {name: bytes}, "bound_bytes": start + sum}``; each term is
  described in ``TERMS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.client.protocol import MAX_HASHES
from kvtier.daemon.access.connection_limits import MAX_HELD_REFUSALS
from kvtier.daemon.server import MAX_LEARN_BACKLOG_KEYS
from kvtier.tiers.policies.chain import HISTORY_KEYS_PER_BLOCK, MIN_HISTORY_KEYS
from kvtier.tiers.policies.session import CHAIN_KEYS_PER_BLOCK, MIN_CHAIN_KEYS
from kvtier.tiers.remote.settings import RemoteTierSettings

MIB = 1 << 20
# One remembered policy key: its record, the key, dict and list entries: ~280 B (chain) and ~220 B
# (a +session chain key) with tracemalloc (docs/operating.md), ~300 B in RSS; room for the allocator.
BYTES_PER_KEY = 512
# One +session stream's own record besides its chain's keys (a dataclass, a heap entry, an
# OrderedDict slot); at most max(1,024, cpu_blocks) streams per pool.
BYTES_PER_STREAM = 1024
MIN_STREAMS = 1024
# One live session: 1.5 KB measured for bare sessions (10,000 hellos), ~3.7 KB documented with
# their pools' bookkeeping (24,915 cost +90 MB); pins and hints are counted with the pool.
BYTES_PER_SESSION = 8 << 10
# One connection that completed the ZMTP handshake: libzmq's engine with its 8 KiB in and out
# buffers, the pipes, the guard's record: 25-29 KB measured (1,500 DEALERs, each answered once).
BYTES_PER_CONNECTION = 48 << 10
# One accepted descriptor that never handshook (a raw connect of a flood): 4 KB measured (1,500).
BYTES_PER_RAW_CONNECTION = 8 << 10
# Everything else: allocator fragmentation after bursts of large messages, Python objects of
# requests in progress, the Redis client's buffers, thread stacks touched. The load suite measures
# 20-40 MiB of such overhead beside its capacity; a hostile mix frees and refills the heap harder.
BASELINE_SLACK_BYTES = 96 * MIB

TERMS = {
    "tiers": "every pool's CPU and GPU tier (host memory without CUDA), named pools as configured, the rest of "
             "max_pools at the default pool's sizes",
    "remote_write_queues": "each remote pool's write-back queue: write_queue_blocks x (block_bytes + 32)",
    "remote_fetch": "one fetch per remote pool: at most its CPU tier's blocks, each a value of block_bytes + 33",
    "replies": "max_unread_reply_bytes_total, passed by at most one reply (max_message_bytes) per connection that "
               "had read everything",
    "policies": "each pool's policy_key_bound x BYTES_PER_KEY, +session streams x BYTES_PER_STREAM, one request's "
                "keys being recorded and the learn backlog (MAX_LEARN_BACKLOG_KEYS + one request) daemon-wide",
    "sessions": "max_sessions x BYTES_PER_SESSION",
    "connections": "(max_connections + refusals held) x BYTES_PER_CONNECTION + the descriptor limit x "
                   "BYTES_PER_RAW_CONNECTION (a flood's accepted, unshed descriptors)",
    "requests": "one request being handled: a header (4 MiB) and a payload (max_message_bytes)",
    "mapped_shm": "shared-memory files clients gave the daemon (arenas, KV tensors) as far as they are touched",
    "slack": "BASELINE_SLACK_BYTES: fragmentation and objects of requests in progress",
}


def policy_key_bound(policy: str, cpu_blocks: int) -> int:
    """The keys a pool's policy may hold, from the configuration (the resident blocks included)."""
    bound = cpu_blocks + max(HISTORY_KEYS_PER_BLOCK * cpu_blocks, MIN_HISTORY_KEYS)
    if policy.endswith("+session"):
        bound += max(CHAIN_KEYS_PER_BLOCK * cpu_blocks, MIN_CHAIN_KEYS)
    return bound


@dataclass(frozen=True)
class PoolSpec:
    name: str
    policy: str
    gpu_bytes: int
    cpu_bytes: int
    block_bytes: int
    remote: bool = False

    @property
    def cpu_blocks(self) -> int:
        return self.cpu_bytes // self.block_bytes


@dataclass(frozen=True)
class DaemonSpec:
    max_sessions: int
    max_connections: int
    nofile: int
    max_unread_reply_bytes_total: int
    max_message_bytes: int
    max_pools: int
    default_gpu_bytes: int
    default_cpu_bytes: int
    default_block_bytes: int  # the smallest block any hello of a pool it does not name may bring
    default_policy: str = "chain"


def rss_bound(start_rss_bytes: int, daemon: DaemonSpec, pools: Sequence[PoolSpec],
              mapped_shm_bytes: int = 0) -> dict[str, object]:
    """See the module docstring."""
    unnamed = max(0, daemon.max_pools - len(pools))
    default = PoolSpec("<default>", daemon.default_policy, daemon.default_gpu_bytes, daemon.default_cpu_bytes,
                       daemon.default_block_bytes)
    every = list(pools) + [default] * unnamed
    remote = RemoteTierSettings()
    policy_bytes = sum(policy_key_bound(p.policy, p.cpu_blocks) * BYTES_PER_KEY
                       + (max(MIN_STREAMS, p.cpu_blocks) * BYTES_PER_STREAM if p.policy.endswith("+session") else 0)
                       for p in every)
    policy_bytes += (MAX_HASHES + MAX_LEARN_BACKLOG_KEYS + MAX_HASHES) * BYTES_PER_KEY
    terms = {
        "tiers": sum(p.gpu_bytes + p.cpu_bytes for p in every),
        "remote_write_queues": sum(remote.write_queue_blocks * (p.block_bytes + 32) for p in every if p.remote),
        "remote_fetch": sum(p.cpu_blocks * (p.block_bytes + 33) for p in every if p.remote),
        "replies": daemon.max_unread_reply_bytes_total + daemon.max_connections * daemon.max_message_bytes,
        "policies": policy_bytes,
        "sessions": daemon.max_sessions * BYTES_PER_SESSION,
        "connections": ((daemon.max_connections + MAX_HELD_REFUSALS) * BYTES_PER_CONNECTION
                        + daemon.nofile * BYTES_PER_RAW_CONNECTION),
        "requests": (4 << 20) + daemon.max_message_bytes,
        "mapped_shm": mapped_shm_bytes,
        "slack": BASELINE_SLACK_BYTES,
    }
    return {"start_bytes": start_rss_bytes, "terms": terms, "bound_bytes": start_rss_bytes + sum(terms.values())}
