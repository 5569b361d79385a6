"""BlockManager: KV block allocation with ref counts, prefix caching and LRU reuse."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from pdserve.engine.block_keys import BlockKey, block_key, namespace_root
from pdserve.engine.kv_events import KvEventLog

MAX_KEYS_PER_EVENT = 4096
"""Most keys in one event (pdserve.v1.KvEvent.keys' bound): a longer run is published in parts."""

#: Root of the key chain for callers that name no namespace (single-model engines, tests).
DEFAULT_ROOT: BlockKey = namespace_root("")


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens (the one ceiling division of tokens into blocks)."""
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    """Owns block ids [0, num_blocks) of one KV pool.

    A block is either in use (ref_count > 0) or free. Free blocks sit in an
    OrderedDict used as an LRU queue: freeing appends at the end, allocation
    takes from the front, so a freed block that still holds a cached prefix stays
    findable by its key for as long as possible. (An OrderedDict gives O(1)
    removal from the middle when a cache hit revives a free block, which a deque
    cannot.) Only blocks whose KV has been fully computed get a key.

    Keys are engine.block_keys keys chained from a namespace `root` (the node's KV
    compatibility and the request's cache salt), so other processes can compute
    them. With `events`, every key stored or evicted is published to that log.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: KvEventLog | None = None,
        before_reuse: Callable[[int], None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.before_reuse = before_reuse
        """Called with a free block before it is handed out to be overwritten (a KV tier still
        copying it out returns once done)."""
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockKey | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockKey, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def prefix_hits(self, token_ids: list[int], root: BlockKey = DEFAULT_ROOT) -> list[int]:
        """Cached blocks holding a prefix of `token_ids` (never the block of the last token,
        which must be computed to produce logits)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = root
        num_full = (len(token_ids) - 1) // self.block_size
        for i in range(num_full):
            parent = block_key(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.hash_to_block.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self, token_ids: list[int], num_tokens: int | None = None, root: BlockKey = DEFAULT_ROOT
    ) -> tuple[list[int], int]:
        """Blocks covering the first `num_tokens` (default: all) of `token_ids`, reusing cached
        prefix blocks. Returns (block ids, number of cached tokens). Caller checks can_allocate."""
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        hits = self.prefix_hits(token_ids[:num_tokens], root)
        for block in hits:
            self._take(block)
        fresh = [self._pop_free() for _ in range(self.blocks_for(num_tokens) - len(hits))]
        return hits + fresh, len(hits) * self.block_size

    def can_allocate(
        self, token_ids: list[int], num_tokens: int | None = None, reserve: int = 0, root: BlockKey = DEFAULT_ROOT
    ) -> bool:
        """Whether allocate() would succeed while leaving `reserve` free blocks."""
        num_tokens = len(token_ids) if num_tokens is None else num_tokens
        hits = self.prefix_hits(token_ids[:num_tokens], root)
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        needed = self.blocks_for(num_tokens) - len(hits) + revived
        return needed + reserve <= len(self.free)

    def append_block(self) -> int:
        """One fresh block for a growing sequence."""
        return self._pop_free()

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero join the LRU tail.
        Freed in reverse so a sequence's last blocks are evicted before its prefix."""
        for block in reversed(block_ids):
            assert self.ref_counts[block] > 0, f"double free of block {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None

    def cache_full_blocks(
        self, token_ids: list[int], block_ids: list[int], num_computed: int, root: BlockKey = DEFAULT_ROOT
    ) -> None:
        """Give a key to every block whose tokens are all computed (so later requests can hit it).

        A block that already has its key passes it on as the next parent without hashing, so
        calling this after every step costs only the blocks completed since the last call.
        Newly keyed blocks are published as `stored` events, one per run of consecutive blocks.
        """
        if not self.enable_prefix_caching:
            return
        parent = root
        run: list[BlockKey] = []
        run_parent = root
        for i in range(min(num_computed // self.block_size, len(block_ids))):
            block = block_ids[i]
            known = self.block_hash[block]
            if known is not None:
                self._publish_stored(run, run_parent)
                run, run_parent, parent = [], known, known
                continue
            key = block_key(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            if key not in self.hash_to_block:
                self.block_hash[block] = key
                self.hash_to_block[key] = block
                run.append(key)
            else:  # the same content is cached in another block: this copy stays unkeyed
                self._publish_stored(run, run_parent)
                run, run_parent = [], key
            parent = key
        self._publish_stored(run, run_parent)

    def _publish_stored(self, keys: list[BlockKey], parent: BlockKey) -> None:
        """One `stored` event per MAX_KEYS_PER_EVENT keys (the wire's bound), each chained on the last."""
        if self.events is None:
            return
        for start in range(0, len(keys), MAX_KEYS_PER_EVENT):
            chunk = keys[start : start + MAX_KEYS_PER_EVENT]
            self.events.stored(chunk, parent)
            parent = chunk[-1]

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        if not self.free:
            raise RuntimeError("out of KV blocks (scheduler should have checked can_allocate)")
        block, _ = self.free.popitem(last=False)
        if self.before_reuse is not None:
            self.before_reuse(block)
        old = self.block_hash[block]
        if old is not None:  # evict: its cached content is about to be overwritten
            del self.hash_to_block[old]
            self.block_hash[block] = None
            if self.events is not None:
                self.events.removed([old])
        self.ref_counts[block] = 1
        return block

    def check_integrity(self, owners: dict[str, list[int]] | None = None) -> None:
        """Assert the invariants; with `owners` (request id -> blocks) also check ref counts."""
        for b in range(self.num_blocks):
            assert (self.ref_counts[b] == 0) == (b in self.free), f"block {b}: ref {self.ref_counts[b]} vs free list"
            assert self.ref_counts[b] >= 0, f"block {b} has negative ref count"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash table points at block {b} which has another hash"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block), "orphan block hash"
        if owners is not None:
            counts = [0] * self.num_blocks
            for blocks in owners.values():
                for b in blocks:
                    counts[b] += 1
            assert counts == self.ref_counts, "ref counts differ from the owners' block lists"
