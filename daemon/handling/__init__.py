"""Around a request: what handlers share, the verbs beyond the dispatch table, waiting and replying.

``daemon/handlers.py`` holds the table and the verbs' checks; this package what they build on.

- ``handler_context``: the context every handler runs in, ``Reply``, ``Pending``, the steps all
  verbs take;
- ``session_memory``: the client-memory verbs (``attach_arena``, ``register_kv``, ``unregister_kv``)
  and copies to and from a session's memory;
- ``stats_verbs``: the ``stats`` verb, and whose view of the daemon a request gets;
- ``parking``: requests waiting for their copies;
- ``replies``: replies on their way out, and the tier memory they lend;
- ``release``: giving back what a session holds once it ends.
"""
