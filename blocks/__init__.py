"""Block bytes in memory: where a block's bytes live, and copies between any two such places.

Contract
========

The layer under both sides of kvtier's data path: ``kvtier.tiers`` (the
daemon's tiers, its transfer engines) and ``kvtier.integrations`` (the
copies an engine adapter makes itself, through its staging arena) import
it; it imports nothing else of kvtier, and no ``zmq`` or ``msgpack``
(``tests/test_architecture.py``). It needs torch (and numpy); ``kvtier.client``
never imports it, so an engine can talk to kvtierd without torch.

- ``layout.BlockLayout``: a set of tensors, each with a dimension that
  indexes blocks; the canonical bytes of a block are the same for every
  shape (the bytes that travel on every data plane, docs/protocol.md).
  ``layout.copy_blocks`` copies between any two layouts, across devices.
- ``copy_plan``: block copies as lists of contiguous byte runs (executed by
  ``execute_plan_cpu`` here, on a GPU by ``kvtier.tiers.cuda_copy``), and
  ``copy_plan.copy_host_blocks``, the host copy every host-to-host copy uses.
"""
