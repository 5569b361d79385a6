"""KvConnector: the one seam between the engine and whatever moves KV into or out of its pool.

The engine never knows about CacheStore sessions, prefill nodes or tiers. It is built with one
connector (`LLMEngine(config, connector=...)`) and calls it at fixed points, in two halves, as
vLLM's v1 KV connector does:

Scheduler side (the engine thread, at admission and at a request's end):

- `match(request, pool_tokens)`: after the engine looked the prompt up in its own prefix cache
  (`pool_tokens` block-aligned tokens hit), may the connector supply the rest of the prompt's KV?
  `None`: no, the scheduler computes it here. An `ExternalKv`: yes, asynchronously; the engine
  allocates the prompt's blocks (sharing the pool's cached prefix, `share_pool`), parks the
  request in WAITING_FOR_REMOTE_KV and calls `after_alloc`. The request leaves that state by
  `LLMEngine.complete_remote_prefill` (the KV landed) or `LLMEngine.prefill_locally` (it did not:
  the request is recomputed here).
- `after_alloc(request, block_ids, held_tokens)`: where the external KV must land (the blocks
  after the first `held_tokens` tokens').
- `request_finished(request)`: the request finished (not aborted); the engine frees its blocks
  unless the request is `prefill_only`, whose blocks stay pinned for a reader until `release`.

Worker side (inside `ModelRunner.run`, on every rank of a tensor-parallel engine, whose ranks
1.. get their own worker-side connector from their rank service):

- `register_kv_pool(pool)`: once, when the pool exists;
- `start_load(batch)` before the first layer, `wait_for_layer(layer)` before a layer's attention
  reads the cache (a tier restoring blocks layer by layer overlaps the load with compute);
- `save_layer(layer, batch)` after a layer wrote its KV (a prefill node streams it from here, so
  sending layer i overlaps computing layer i+1), and `wait_for_save()` after the last layer.

Implementations: `RemotePrefillPolicy` (decode node: which prompts a prefill node fills,
`pdserve.engine.remote_prefill`) and `LayerStreamer` (prefill node and its ranks: each layer to
the decode node, `pdserve.node_runtime.rank_kv`). A KV tier plugs in at the same points: `match`
for a lookup below the pool, `wait_for_layer` for the overlapped restore, `request_finished` and
`save_layer` for what goes down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.request import Request


class ExternalKv(NamedTuple):
    """The connector supplies a prompt's KV (asynchronously) beyond what the pool shares."""

    share_pool: bool = True
    """Share the pool's cached prefix blocks (never written; the source fills only the rest), or
    take every block fresh and have the source fill the whole prompt."""


class KvSource(NamedTuple):
    """Where an admitted request's prompt KV comes from (what `LLMEngine.add_request` returns)."""

    location: str
    """"local" (the scheduler computes what the pool lacks) or "remote" (parked in
    WAITING_FOR_REMOTE_KV; the connector's source fills the blocks after `held_tokens`)."""
    block_ids: list[int]
    """Remote: every block of the prompt, the shared ones first. Local: empty."""
    held_tokens: int
    """Block-aligned prompt tokens whose KV the pool already holds (remote: never transferred)."""


class KvConnector:
    """The engine's KV seam; every method is a no-op here, so an implementation overrides only
    the half it needs (see the module docstring for when each is called)."""

    # --- scheduler side ----------------------------------------------------------------------
    def match(self, request: Request, pool_tokens: int) -> ExternalKv | None:
        return None

    def after_alloc(self, request: Request, block_ids: list[int], held_tokens: int) -> None:
        return None

    def request_finished(self, request: Request) -> None:
        return None

    # --- worker side -------------------------------------------------------------------------
    def register_kv_pool(self, pool: KVPool) -> None:
        return None

    def start_load(self, batch: ForwardBatch) -> None:
        return None

    def wait_for_layer(self, layer: int) -> None:
        return None

    def save_layer(self, layer: int, batch: ForwardBatch) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


NO_CONNECTOR = KvConnector()
"""The connector of an engine built without one: KV never leaves or enters the pool."""
