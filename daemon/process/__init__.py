"""The daemon process's life: signals, systemd, the listening socket, upgrades and a standby.

- ``lifecycle``: the stop flag SIGTERM and SIGINT set, SIGUSR2's upgrade request, and the refusal to
  start where a live daemon serves;
- ``sd_notify``: READY, STATUS, WATCHDOG and STOPPING to systemd, without a dependency;
- ``listener``: the listening socket: bound here, inherited from systemd, or handed over;
- ``control_channel``: the channel between a serving kvtierd and a kvtierd it starts beside itself;
- ``handover``: the two ends of a hand-over: the predecessor's mechanics and the successor's side;
- ``upgrade``: the serving daemon's side of an upgrade, one step per loop iteration;
- ``standby``: a second, started kvtierd that serves the moment the primary dies.
"""
