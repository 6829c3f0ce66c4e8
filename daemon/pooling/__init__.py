"""The daemon's pools and the host memory they take.

- ``pools``: (tenant, name) -> ``TieredPool``, with the layout that created it;
- ``pool_admission``: which pools the daemon may hold: sizing a new one, reclaiming idle ones;
- ``memory``: the host-memory budget: every pool's CPU tier, checked before it is allocated;
- ``heap_trim``: giving reply buffers' memory back to the kernel once a backlog drained.
"""
