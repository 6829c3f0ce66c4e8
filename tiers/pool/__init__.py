"""The tiered pool: one KV layout's GPU tier, CPU tier (and remote tier), and the copies between them.

``TieredPool`` (``facade.py``, whose docstring is the contract) is the only
thing the daemon and the tools use of ``kvtier.tiers``. Its parts, one
concern each:

- ``base``: ``Tier``, ``PoolSpec``, ``Borrowed``, the errors, the ``Held`` record.
- ``copies``: ``Op`` and the copy scheduler, the one place that keeps a slot
  from being reused while a copy touches it.
- ``resolve``: prefix resolution across GPU, CPU and remote tiers.
- ``pins``: owners' pins.  ``learning``: when the CPU policy learns.
- ``demotion``: demoting evicted blocks, and clean-ahead.  ``polling``: the pool's ``poll``.
- ``engine``: allocate/append/free.  ``store``: store/restore.  ``lending``: borrow.
- ``adoption``: a persistent CPU tier.  ``journal``: the keys held, for routers.
- ``counters``: the counters, declared once.  ``state``: the GPU tier the parts share.

The facade builds each part from the collaborators it uses (the CPU tier,
the copy scheduler, the counters, the parts it calls, ``PoolState``); no
part imports or names the facade, and the object graph has no cycle: a
dropped pool is freed by reference count.
"""

from kvtier.tiers.pool.base import Borrowed, Held, NoSpace, NotFound, PoolError, PoolSpec, Tier
from kvtier.tiers.pool.copies import Op
from kvtier.tiers.pool.counters import Counters
from kvtier.tiers.pool.facade import TieredPool, WrapPolicy
from kvtier.tiers.pool.learning import LEARN_CHUNK_KEYS

__all__ = [
    "LEARN_CHUNK_KEYS",
    "Borrowed",
    "Counters",
    "Held",
    "NoSpace",
    "NotFound",
    "Op",
    "PoolError",
    "PoolSpec",
    "Tier",
    "TieredPool",
    "WrapPolicy",
]
