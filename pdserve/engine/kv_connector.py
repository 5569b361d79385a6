"""KvConnector: the one seam between the engine and whatever moves KV into or out of its pool.

The engine never knows about CacheStore sessions, prefill nodes or tiers. It is built with one
connector (`LLMEngine(config, connector=...)`) and calls it at fixed points, in two halves, as
vLLM's v1 KV connector does:

Scheduler side (the engine thread, at admission and at a request's end):

- `match(request, pool_tokens)`: after the engine looked the prompt up in its own prefix cache
  (`pool_tokens` block-aligned tokens hit), may the connector supply more of the prompt's KV?
  `None`: no, the scheduler computes it here. An `ExternalKv` with `load_tokens`: the connector
  holds the next that many tokens' blocks (a tier below the pool); the engine allocates pool
  blocks for them, calls `load(request, block_ids)` at once, keys them into its prefix cache, and
  asks `match` once more with the larger hit. An `ExternalKv` without: the rest of the prompt
  arrives asynchronously; the engine allocates the prompt's blocks (sharing the pool's cached
  prefix, `share_pool`), parks the request in WAITING_FOR_REMOTE_KV and calls `after_alloc`. The
  request leaves that state by `LLMEngine.complete_remote_prefill` (the KV landed) or
  `LLMEngine.prefill_locally` (it did not: the request is recomputed here).
- `load(request, block_ids)`: copy what `match` offered into these fresh pool blocks (False:
  it could not, and those tokens are computed instead); `forget(request)`: the engine will not
  load what `match` offered (no room, or the request was refused). True guarantees the KV: a
  tier may copy it later, layer by layer in the next forward (`start_load`, `wait_for_layer`),
  but must then land it before any reader: `before_reuse` of such a block and `finish_loads`
  (the engine is about to hand blocks to a reader outside a forward: a remote prefill's D->P
  pull) land it at once.
- `after_alloc(request, block_ids, held_tokens)`: where the external KV must land (the blocks
  after the first `held_tokens` tokens').
- `request_finished(request)`: the request finished (not aborted); the engine frees its blocks
  unless the request is `prefill_only`, whose blocks stay pinned for a reader until `release`.
- `before_reuse(block_id)`: a free block is about to be handed out and overwritten (a connector
  still reading it, e.g. a tier's writer, returns only when done).
- `register_blocks(blocks)`: once, when the block manager exists: the engine's `PoolBlocks`
  (`pdserve.engine.pool_blocks`), through which a connector holds pool blocks outside any request
  (room kept for the engine's requests) and then keys or frees them; the only way it takes blocks.
- `owned_blocks()`: the blocks it holds that way now, by a name (`LLMEngine.check_integrity`
  counts them as owners beside the requests).

Worker side (inside `ModelRunner.run`, on every rank of a tensor-parallel engine, whose ranks
1.. get their own worker-side connector from their rank service):

- `register_kv_pool(pool)`: once, when the pool exists;
- `start_load(batch)` before the first layer, `wait_for_layer(layer)` before a layer's attention
  reads the cache (a tier restoring blocks layer by layer overlaps the load with compute);
- `save_layer(layer, batch)` after a layer wrote its KV (a prefill node streams it from here, so
  sending layer i overlaps computing layer i+1), and `wait_for_save()` after the last layer.

Implementations: `RemotePrefillPolicy` (decode node: which prompts a prefill node fills,
`pdserve.engine.remote_prefill`), `LayerStreamer` (prefill node and its ranks: each layer to the
decode node, `pdserve.node_runtime.rank_kv`), `PullConnector` (prefill node: blocks that receive a
prefix a decode node holds, a D->P pull, `pdserve.engine.kv_pull`), `HostKvTier` (a host-memory
tier below the pool, `pdserve.engine.kv_tier`) and `SharedKvStore` (a store shared by nodes below
the host tier, `pdserve.engine.kv_shared_store`). `KvConnectors` chains several: the engine of a
decode node with a tier asks the tier first, then the remote-prefill policy; a prefill node's
engine chains its layer streamer and its pull connector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pdserve.engine.forward_batch import ForwardBatch
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.pool_blocks import PoolBlocks
    from pdserve.engine.request import Request


class ExternalKv(NamedTuple):
    """The connector supplies KV of a prompt beyond what the pool holds."""

    share_pool: bool = True
    """Asynchronous: share the pool's cached prefix blocks (never written; the source fills only
    the rest), or take every block fresh and have the source fill the whole prompt."""
    load_tokens: int = 0
    """Synchronous: the connector holds the next this many (block-aligned) prompt tokens' KV and
    `load` copies it now; 0: asynchronous, the whole rest of the prompt."""


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

    def before_reuse(self, block_id: int) -> None:
        return None

    def load(self, request: Request, block_ids: list[int]) -> bool:
        return False

    def forget(self, request: Request) -> None:
        return None

    def finish_loads(self) -> None:
        return None

    def register_blocks(self, blocks: PoolBlocks) -> None:
        return None

    def owned_blocks(self) -> dict[str, list[int]]:
        return {}

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

    def close(self) -> None:
        """The engine is closing: stop any thread of the connector's own."""
        return None


class KvConnectors(KvConnector):
    """Several connectors as one: `match` asks each in order and the first answer wins (its
    `load`/`after_alloc` follow it); every other hook reaches all of them."""

    def __init__(self, *connectors: KvConnector) -> None:
        self.connectors = connectors
        self._chosen: dict[str, KvConnector] = {}

    def match(self, request: Request, pool_tokens: int) -> ExternalKv | None:
        for connector in self.connectors:
            found = connector.match(request, pool_tokens)
            if found is not None:
                self._chosen[request.request_id] = connector
                return found
        return None

    def after_alloc(self, request: Request, block_ids: list[int], held_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        if chosen is not None:
            chosen.after_alloc(request, block_ids, held_tokens)

    def load(self, request: Request, block_ids: list[int]) -> bool:
        chosen = self._chosen.pop(request.request_id, None)
        return chosen.load(request, block_ids) if chosen is not None else False

    def forget(self, request: Request) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        if chosen is not None:
            chosen.forget(request)

    def request_finished(self, request: Request) -> None:
        for connector in self.connectors:
            connector.request_finished(request)

    def finish_loads(self) -> None:
        for connector in self.connectors:
            connector.finish_loads()

    def before_reuse(self, block_id: int) -> None:
        for connector in self.connectors:
            connector.before_reuse(block_id)

    def register_blocks(self, blocks: PoolBlocks) -> None:
        for connector in self.connectors:
            connector.register_blocks(blocks)

    def owned_blocks(self) -> dict[str, list[int]]:
        owned: dict[str, list[int]] = {}
        for connector in self.connectors:
            owned |= connector.owned_blocks()
        return owned

    def register_kv_pool(self, pool: KVPool) -> None:
        for connector in self.connectors:
            connector.register_kv_pool(pool)

    def start_load(self, batch: ForwardBatch) -> None:
        for connector in self.connectors:
            connector.start_load(batch)

    def wait_for_layer(self, layer: int) -> None:
        for connector in self.connectors:
            connector.wait_for_layer(layer)

    def save_layer(self, layer: int, batch: ForwardBatch) -> None:
        for connector in self.connectors:
            connector.save_layer(layer, batch)

    def wait_for_save(self) -> None:
        for connector in self.connectors:
            connector.wait_for_save()

    def close(self) -> None:
        for connector in self.connectors:
            connector.close()


NO_CONNECTOR = KvConnector()
"""The connector of an engine built without one: KV never leaves or enters the pool."""
