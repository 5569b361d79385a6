"""PoolBlocks: the engine's pool as a connector may hold blocks of it outside any request.

Two KV sources fill pool blocks that belong to no request yet: a tier below the pool restores a
prefix into them at admission (`LLMEngine.add_request`), and a D->P pull has a decode node write a
prefix into them before the Prefill call that uses it arrives (`PullConnector`). Both do the same
three things, defined once here: `hold` blocks for a block-aligned prompt prefix (the part the
prefix cache already holds shared, so its keys cannot be evicted meanwhile; the rest fresh),
only while room is left for what the engine's requests may still need; then `release` them,
keyed first when their KV is complete, so that they stay in the prefix cache and the next request
with that prefix hits them like any cached prefix, or unkeyed when it is not.

The engine hands its one `PoolBlocks` to its connector (`KvConnector.register_blocks`). Not
thread-safe, like the engine: call it from the engine thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from pdserve.engine.kv_namespace import request_root

if TYPE_CHECKING:
    from pdserve.engine.block_keys import BlockKey
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import Scheduler


class HeldBlocks(NamedTuple):
    """Blocks `PoolBlocks.hold` took for a prompt prefix."""

    block_ids: list[int]
    """Every block of the prefix in prompt order, the ones the prefix cache held first."""
    cached_tokens: int
    """Tokens of the prefix those shared blocks hold (block aligned)."""


class PoolBlocks:
    """Hold and release blocks of the engine's pool outside any request (see the module doc).
    `holders` lists the engine's requests, for which room is kept (`Scheduler.reserved_blocks`)."""

    def __init__(
        self,
        block_manager: BlockManager,
        scheduler: Scheduler,
        holders: Callable[[], list[Request]],
        kv_compatibility: str,
    ) -> None:
        self._bm = block_manager
        self._scheduler = scheduler
        self._holders = holders
        self._kv_compatibility = kv_compatibility

    @property
    def block_size(self) -> int:
        return self._bm.block_size

    @property
    def prefix_caching(self) -> bool:
        """Whether blocks can be keyed at all (off: nothing released stays findable)."""
        return self._bm.enable_prefix_caching

    def root(self, cache_salt: str | None) -> BlockKey:
        """The key namespace of a prompt with this cache salt (what the engine's requests use)."""
        return request_root(self._kv_compatibility, cache_salt)

    def cached_blocks(self, tokens: list[int], root: BlockKey) -> int:
        """Leading blocks of `tokens` the prefix cache holds (never the last token's block)."""
        return len(self._bm.prefix_hits(tokens, root))

    def hold(self, tokens: list[int], num_tokens: int, root: BlockKey) -> HeldBlocks | None:
        """Blocks for `tokens[:num_tokens]` (block aligned): the cached prefix shared, the rest
        fresh. None when the pool has no room for them beyond what the engine's requests may still
        need. The last block of the prefix is always fresh (a prefix hit never covers the last
        token's block), which is what a source that supplies the prefix's end wants."""
        reserve = self._scheduler.reserved_blocks(self._holders())
        if not self._bm.can_allocate(tokens, num_tokens, reserve=reserve, root=root):
            return None
        block_ids, cached = self._bm.allocate(tokens, num_tokens, root)
        return HeldBlocks(block_ids, cached)

    def release(self, tokens: list[int], block_ids: list[int], num_tokens: int, root: BlockKey, *, keep: bool) -> int:
        """Drop a hold. `keep`: the blocks' KV of `tokens[:num_tokens]` is complete, so they are
        keyed first and stay in the prefix cache; else the fresh ones go back unkeyed. The caller
        makes sure nothing writes into them any more. Returns the blocks newly keyed."""
        before = len(self._bm.hash_to_block)
        if keep:
            self._bm.cache_full_blocks(tokens, block_ids, num_tokens, root)
        self._bm.free_blocks(block_ids)
        return len(self._bm.hash_to_block) - before
