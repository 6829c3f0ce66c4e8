"""kvtier.testing: what tests, benchmarks and examples need to run kvtier, never kvtier itself.

- ``kvtier.testing.daemon``: ``KvtierDaemon``, kvtierd as a child process
  (start, wait until it answers, signal, restart, stop, its log).
- ``kvtier.testing.redis_servers``: real ``redis-server`` processes on
  loopback, standalone and a 3-node Cluster (needs the ``remote`` extra).
- ``kvtier.testing.cuda_emulation``: the CUDA copy kernel's arithmetic on the CPU.
- ``kvtier.testing.vllm_requests``: ``FakeRequest``, what the connector reads
  of a vLLM request.
- ``kvtier.testing.transfer_hooks``: ``HookedTransferEngine``, the thread
  copy engine with a hook a test sets to delay or fail its copies.
- ``kvtier.testing.other_uid``: a launcher that runs kvtierd as another
  uid (root drops privileges in the daemon's own process), for the
  multi-user set-up.

Nothing here imports pytest (benchmarks and examples use it as plain
code), and nothing in tiers, client, daemon, tools or integrations imports
this package (both are import-linter contracts in pyproject.toml). This
``__init__`` imports none of its modules: each pulls in only its own
dependencies (redis, torch) when imported.
"""
