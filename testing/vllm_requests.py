"""``FakeRequest``: the attributes of ``vllm.v1.request.Request`` that kvtier's vLLM connector reads.

Used by tests/integrations/test_vllm_scheduler.py and bench/vllm.py to drive
``SchedulerSide`` (and ``RequestKeys``) without an engine. It imports no
vLLM: the connector reads these attributes by name, so a plain object does.
"""

from __future__ import annotations

from typing import Any


class FakeRequest:
    """What ``SchedulerSide`` (hints included) and ``RequestKeys`` read: a prompt; no LoRA, salt, images or hints."""

    def __init__(self, request_id: str, tokens: list[int], kv_transfer_params: Any = None) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        self.num_tokens = len(tokens)
        self.prompt_token_ids = tokens
        self.lora_request = None
        self.cache_salt = None
        self.mm_features: list[Any] = []
        self.kv_transfer_params = kv_transfer_params
        self.session_id = None
        self.kv_hints = None
        self.num_output_tokens = 0  # vLLM's counts the tokens generated so far; a driver sets it
        self.num_computed_tokens = 0  # vLLM's: tokens whose KV the engine holds; a driver sets it
