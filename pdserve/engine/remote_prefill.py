"""RemotePrefillPolicy: the decode node's connector (scheduler side): which prompts a prefill node fills.

A decode node holds the KV of every conversation it served, keyed in its prefix cache, so a new
turn usually finds most of its prompt there. Per request (`kv_transfer_params`, as vLLM's P/D
connectors read them):

- local: no prefill node is usable (`do_remote_prefill` unset), or the part of the prompt this
  node lacks is short, so the request queues here and the scheduler prefills it from the cached
  prefix;
- remote: the cached prefix blocks are shared (ref counted, never written: they are keyed and so
  immutable), only the missing blocks are allocated, and a prefill node fills just those.

The engine does the allocation and the WAITING_FOR_REMOTE_KV transitions (`LLMEngine.add_request`,
`complete_remote_prefill`, `prefill_locally`); the node does the transfer (`pdserve.decode_node`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.kv_connector import ExternalKv, KvConnector

if TYPE_CHECKING:
    from pdserve.engine.request import Request

DO_REMOTE_PREFILL = "do_remote_prefill"
"""The `kv_transfer_params` key that offers a request to a prefill node (vLLM's P/D name)."""


class RemotePrefillPolicy(KvConnector):
    """Remote when offered (`do_remote_prefill`) unless, with `reuse`, the prompt tokens this node
    lacks are at most `local_max_tokens` (0: never local by length). Without `reuse` this is the
    path from before cache-aware disaggregation: every block fresh, the whole prompt filled remotely."""

    def __init__(self, *, reuse: bool = True, local_max_tokens: int = 0) -> None:
        self.reuse = reuse
        self.local_max_tokens = local_max_tokens

    def match(self, request: Request, pool_tokens: int) -> ExternalKv | None:
        if not request.kv_transfer_params.get(DO_REMOTE_PREFILL):
            return None
        if not self.reuse:
            return ExternalKv(share_pool=False)
        lacking = request.num_prompt_tokens - pool_tokens
        if 0 < self.local_max_tokens and lacking <= self.local_max_tokens:
            return None
        return ExternalKv()
