"""Who may connect, and how much one peer may cost: connections, their caps, CURVE, tokens.

- ``connections``: one client connection of the ROUTER socket, and how to end it;
- ``connection_limits``: caps on connections per peer and in total, enforced as libzmq accepts them;
- ``descriptors``: the file descriptors, shared out between spares, connections and mapped files;
- ``gil_held``: socket and libzmq calls that keep the GIL, for threads that must not queue behind
  the loop;
- ``security``: CURVE: the daemon's key pair, the authorised client keys, the ZAP handler;
- ``auth_limits``: how many wrong tenant tokens one peer may try;
- ``log_limit``: log lines a client can cause, capped per kind.
"""
