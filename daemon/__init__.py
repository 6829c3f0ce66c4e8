"""kvtierd, the daemon: its entry point, its event loop and dispatch table, and one package per family.

- ``__main__``: ``kvtierd`` / ``python -m kvtier.daemon``, the composition root;
- ``server``: the event loop (one ROUTER socket, one thread); ``handlers``: the dispatch table;
- ``faults``: test-only fault injection, imported by ``__main__`` alone;
- ``config``: the configuration; ``planes``: the data planes of ``store`` and ``restore``;
- ``process``: the daemon process's life: signals, systemd, the listening socket, upgrades and a standby;
- ``access``: who may connect, and how much one peer may cost: connections, their caps, CURVE, tokens;
- ``tenancy``: tenants: who a session belongs to, its private block namespace and its CPU-tier quota;
- ``telemetry``: what the daemon tells its operator: counters, and the Prometheus endpoint that serves them;
- ``pooling``: the daemon's pools and the host memory they take;
- ``clients``: client sessions and what each holds, until its lease ends;
- ``shared_memory``: memory a client owns and shares with the daemon: touched safely, and only in time;
- ``handling``: around a request: what handlers share, the verbs beyond the dispatch table, waiting and replying;

docs/architecture.md says which family may import which.
"""
