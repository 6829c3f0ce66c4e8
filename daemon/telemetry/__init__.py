"""What the daemon tells its operator: counters, and the Prometheus endpoint that serves them.

- ``metrics``: the daemon-level counters and gauges (``Counters``);
- ``prometheus``: the ``stats`` reply as Prometheus metrics, handed from the loop to other threads;
- ``metrics_endpoint``: the HTTP endpoint: ``/metrics`` from one thread.
"""
