"""PullConnector: the prefill node's connector for D->P pulls (blocks that receive a prefix the
decode node holds).

When a decode node holds a block-aligned prefix of a prompt that this engine's prefix cache lacks,
the decode node can write those blocks into this engine's pool (over CacheStore) instead of this
engine recomputing them. The node (`pdserve.prefill_node.kv_pull`) drives this connector from the
engine thread: `reserve` holds the blocks through the engine's `PoolBlocks` (the prefix blocks
already cached here are shared, so their keys cannot be evicted under the pull); `finish` keys the
received blocks into the prefix cache or, when the pull failed, frees them unkeyed. The node
fences the CacheStore session before `finish`: no writer is inside the blocks by then.

A pull belongs to no request of the engine: it lands before the Prefill call that uses it
arrives, and what it leaves behind is ordinary prefix-cache blocks, which that request (or a retry
of it, or any concurrent request with the same prefix) hits like any cached prefix. So of the
connector's hooks it uses the two about blocks held outside requests: `register_blocks` (how it
reserves) and `owned_blocks` (the pending pulls' blocks, which `LLMEngine.check_integrity` counts).
Its pulls are not settled in `match`: the fence waits on the network, which the engine thread
never does, and a Prefill call may fail before its request reaches the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pdserve.engine.kv_connector import KvConnector

if TYPE_CHECKING:
    from pdserve.engine.block_keys import BlockKey
    from pdserve.engine.pool_blocks import PoolBlocks


class PendingPull(NamedTuple):
    """Blocks held for one pull until `PullConnector.finish`."""

    block_ids: list[int]
    """Every block of the pulled prefix, the ones already cached here first."""
    tokens: list[int]
    """The pulled prefix's tokens (block aligned)."""
    root: BlockKey
    """The request's key namespace (compatibility + cache salt)."""


class PullConnector(KvConnector):
    """Blocks held for D->P pulls, by request id (at most one per request), until settled.
    Engine thread only, like every connector's scheduler side."""

    def __init__(self) -> None:
        self.blocks: PoolBlocks | None = None
        self.pending: dict[str, PendingPull] = {}

    def register_blocks(self, blocks: PoolBlocks) -> None:
        self.blocks = blocks

    def owned_blocks(self) -> dict[str, list[int]]:
        return {f"pull:{rid}": p.block_ids for rid, p in self.pending.items()}

    def reserve(
        self, pull_id: str, prompt: list[int], held_tokens: int, min_blocks: int, cache_salt: str | None = None
    ) -> tuple[list[int], int] | None:
        """Blocks to receive the KV of `prompt[:held_tokens]` (block aligned, below the prompt
        length) that this engine lacks: (fresh block ids in prompt order, index of the first one
        in the prompt). None when prefix caching is off, when fewer than `min_blocks` (at least
        1) blocks are missing, or when the pool has no room beyond what its requests may still need."""
        blocks = self.blocks
        assert blocks is not None, "PullConnector used before the engine registered its blocks"
        if pull_id in self.pending:
            raise ValueError(f"a pull for request {pull_id!r} is already pending")
        bs = blocks.block_size
        if not blocks.prefix_caching or held_tokens % bs or not 0 < held_tokens < len(prompt):
            return None
        root = blocks.root(cache_salt)
        held_blocks = held_tokens // bs
        have = min(blocks.cached_blocks(prompt, root), held_blocks)
        if held_blocks - have < max(1, min_blocks):
            return None
        held = blocks.hold(prompt, held_tokens, root)
        if held is None:
            return None
        assert held.cached_tokens == have * bs, (held.cached_tokens, have)
        self.pending[pull_id] = PendingPull(held.block_ids, list(prompt[:held_tokens]), root)
        return held.block_ids[have:], have

    def finish(self, pull_id: str, landed: bool) -> int:
        """Release a pull's blocks. `landed`: every block arrived intact, so they are keyed first
        and stay cached; else the fresh ones go back unkeyed. Returns the blocks keyed (0 if none
        or the pull is unknown). The caller has fenced the session: no write can still land."""
        pull = self.pending.pop(pull_id, None)
        if pull is None:
            return 0
        assert self.blocks is not None  # a pull was reserved through them
        return self.blocks.release(pull.tokens, pull.block_ids, len(pull.tokens), pull.root, keep=landed)
