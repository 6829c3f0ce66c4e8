"""Engine adapters: kvtier as the KV-cache tier of an inference engine people run.

Each adapter is a subpackage named after its engine (``kvtier.integrations.vllm``)
and imports that engine when it is imported, never before: importing
``kvtier.integrations`` itself imports no engine. ``client/`` and ``tiers/``
never import an engine; adapters build on ``kvtier.client`` (and on
``kvtier.tiers.layout`` for copies they make themselves).
"""
