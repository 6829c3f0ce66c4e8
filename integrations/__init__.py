"""Engine adapters: kvtier as the KV-cache tier of an inference engine people run.

Each adapter is a subpackage named after its engine (``kvtier.integrations.vllm``)
and imports that engine when it is imported, never before: importing
``kvtier.integrations`` itself imports no engine. Adapters build on
``kvtier.integrations.adapter``, the engine-free half every adapter shares
(the link to kvtierd, background lookups, load modes, transfers, data
planes, hints, stats), and through it on ``kvtier.client``; never on
``kvtier.tiers`` or ``kvtier.daemon``. ``client/`` and ``tiers/`` never
import an engine.
"""
