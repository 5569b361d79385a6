"""The prefill node's half of a D->P pull: blocks that receive a prefix the decode node holds.

`LLMEngine.pulls`. When a decode node holds a block-aligned prefix of a prompt that this
engine's prefix cache lacks, the decode node can write those blocks into this engine's pool
(over CacheStore) instead of this engine recomputing them. `reserve` allocates the blocks
(the prefix blocks already cached here are shared, so their keys cannot be evicted under the
pull); `finish` keys the received blocks into the prefix cache (the prefill request that
follows then hits them, like any cached prefix) or, when the pull failed, frees them unkeyed.
The caller fences the CacheStore session before `finish`: no writer is inside the blocks.

Unlike the engine's `KvConnector`, a pull belongs to no request: it lands before the Prefill
call that uses it arrives, and what it leaves behind is ordinary prefix-cache blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

from pdserve.engine.block_keys import BlockKey
from pdserve.engine.kv_namespace import request_root

if TYPE_CHECKING:
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.request import Request
    from pdserve.engine.scheduler import Scheduler


class PendingPull(NamedTuple):
    """Blocks held for one pull until `PullReservations.finish`."""

    block_ids: list[int]
    """Every block of the pulled prefix, the ones already cached here first."""
    tokens: list[int]
    """The pulled prefix's tokens (block aligned)."""
    root: BlockKey
    """The request's key namespace (compatibility + cache salt)."""


class PullReservations:
    """Blocks held for D->P pulls until they are settled (they count as block owners in
    `LLMEngine.check_integrity`). `holders` lists the engine's requests, which room is kept for."""

    def __init__(
        self,
        block_manager: BlockManager,
        kv_compatibility: str,
        holders: Callable[[], list[Request]],
        scheduler: Scheduler,
    ) -> None:
        self.block_manager = block_manager
        self.kv_compatibility = kv_compatibility
        self.holders = holders
        self.scheduler = scheduler
        self.pulls: dict[str, PendingPull] = {}

    def reserve(
        self, pull_id: str, prompt: list[int], held_tokens: int, min_blocks: int, cache_salt: str | None = None
    ) -> tuple[list[int], int] | None:
        """Blocks to receive the KV of `prompt[:held_tokens]` (block aligned, below the prompt
        length) that this engine lacks: (fresh block ids in prompt order, index of the first one
        in the prompt). None when prefix caching is off, when fewer than `min_blocks` (at least
        1) blocks are missing, or when the pool has no room beyond what its requests may still need."""
        bm = self.block_manager
        if pull_id in self.pulls:
            raise ValueError(f"a pull for request {pull_id!r} is already pending")
        if not bm.enable_prefix_caching or held_tokens % bm.block_size or not 0 < held_tokens < len(prompt):
            return None
        root = request_root(self.kv_compatibility, cache_salt)
        held_blocks = held_tokens // bm.block_size
        have = min(len(bm.prefix_hits(prompt, root)), held_blocks)
        if held_blocks - have < max(1, min_blocks):
            return None
        reserve = self.scheduler.reserved_blocks(self.holders())
        if not bm.can_allocate(prompt, held_tokens, reserve=reserve, root=root):
            return None
        # allocate() never reuses the last block of what it covers; that block is missing here anyway
        block_ids, cached = bm.allocate(prompt, held_tokens, root)
        assert cached == have * bm.block_size, (cached, have)
        self.pulls[pull_id] = PendingPull(block_ids, list(prompt[:held_tokens]), root)
        return block_ids[have:], have

    def finish(self, pull_id: str, landed: bool) -> int:
        """Release a pull's blocks. `landed`: every block arrived intact, so they are keyed first
        and stay cached; else the fresh ones go back unkeyed. Returns the blocks keyed (0 if none
        or the pull is unknown). The caller has fenced the session: no write can still land."""
        pull = self.pulls.pop(pull_id, None)
        if pull is None:
            return 0
        bm = self.block_manager
        before = len(bm.hash_to_block)
        if landed:
            bm.cache_full_blocks(pull.tokens, pull.block_ids, len(pull.tokens), pull.root)
        bm.free_blocks(pull.block_ids)
        return len(bm.hash_to_block) - before

    def owners(self) -> dict[str, list[int]]:
        """Blocks each pending pull holds, by `pull:<request id>` (for check_integrity)."""
        return {f"pull:{rid}": p.block_ids for rid, p in self.pulls.items()}
