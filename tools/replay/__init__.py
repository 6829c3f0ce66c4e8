"""`kvtier replay`: drive the real tiers code with a request trace and report hit rates.

Modules (imports point down this list):

- ``cli``       the ``kvtier replay`` command: arguments, checks, JSON and text output.
- ``report``    the text tables (one run, a sweep, several nodes).
- ``nodes``     ``--nodes``: several simulated nodes sharing a simulated remote tier.
- ``core``      the single-node replay (``replay``, ``sweep``, ``ReplayConfig``, ``ACCOUNTING``).
- ``progress``  the progress bar.

The replay builds a ``TieredPool`` in bookkeeping-only mode (``data=False``,
no transfer engine, no bytes: every copy completes at once), with the same
block manager (GPU tier) and CPU tier the daemon uses, and clean-ahead off
(a block is demoted when the GPU tier evicts it). It is not a second
implementation of the tiers.

Accounting (also written into the JSON report, ``ACCOUNTING``):

1. Requests are processed one at a time, in trace (arrival) order; nothing
   overlaps. Timestamps are carried but not used by the pool.
2. Only full blocks count: block i of a request is full when
   (i+1)·block_size ≤ input_length. These are the request's looked-up blocks.
3. A request's blocks hit in order until the first block that is in no tier
   (prefix-stop); that block and every later one are misses. A hit counts for
   the first tier that holds it, GPU then CPU. (The pool's exact rule: the run
   of GPU-held blocks, then the run of CPU-held blocks; a GPU-held block after
   the CPU run began counts only if the CPU tier holds it too. On the shipped
   traces this never differs from the plain rule.)
4. The request's full blocks are then allocated in the GPU tier as the engine
   would (``pool.allocate(request, keys, len(keys)·block_size)``: GPU hits are
   touched, CPU hits restored into new slots, the rest allocated, evicting the
   least recently freed blocks, each evicted block demoted to the CPU tier
   if the CPU tier's policy admits it and does not hold it already), and freed
   last-to-first (vLLM order, ``pool.free``), so they stay cached.
5. A request with more full blocks than the GPU tier has (an engine could not
   hold its prompt): all its blocks are looked up and counted as in 3; then
   only its first ``gpu_blocks`` blocks are allocated and freed, the rest are
   not cached. Counted as ``truncated_requests`` / ``truncated_blocks``.
6. Block hit rate = hit blocks / looked-up blocks (per tier and total).
   Token-weighted hit rate = hit blocks · block_size / input tokens of all
   requests (the share of prompt tokens whose prefill is skipped; partial
   trailing blocks are in the denominator and never hit).
7. Bytes moved: demotions · block_bytes (GPU→CPU) and restores · block_bytes
   (CPU→GPU). ``block_bytes`` is a figure given on the command line (default
   512 tokens × 128 KiB per token, e.g. Llama-3.1-8B in bf16).
8. Bounds with the same accounting (``kvtier.tools.belady``): the infinite
   cache (a block hits iff it and every block before it were seen in an
   earlier request) and Belady's MIN for ONE cache of gpu_blocks + cpu_blocks.
"""

from kvtier.tools.replay.cli import main, register
from kvtier.tools.replay.core import ACCOUNTING, DEFAULT_POLICY, ReplayConfig, ReplayResult, replay, sweep

__all__ = [
    "ACCOUNTING",
    "DEFAULT_POLICY",
    "ReplayConfig",
    "ReplayResult",
    "main",
    "replay",
    "sweep",
    "register",
]
