"""Memory a client owns and shares with the daemon: touched safely, and only in time.

- ``client_memory``: copies to and from a client's files that never fault the daemon;
- ``kv_import``: opening the KV tensors an engine registered (``/dev/shm`` files, CUDA IPC);
- ``deadlines``: a request's deadline, after which a client's memory is not touched.
"""
