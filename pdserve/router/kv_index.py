"""KvIndex: the router's bounded map of which node holds which KV block key.

Fed by the nodes' KvEvents streams (router/kv_subscriber.py) or, in the trace replay, by the
simulated nodes' engine KvEventLogs. Only nodes whose stream is *synced* (a complete snapshot
plus every event since, without a gap) are matched: a node that is resyncing, disconnected,
restarted or unusable counts as cold, so a stale entry can never win a routing decision.

Bounded: a node holds at most `node_cap` keys (its reported pool size when known: a node can
never hold more keys than blocks) and the index at most `max_entries` in all. Over a cap, the
node's oldest keys are forgotten first. Forgetting is always safe: it can only make the
router under-estimate a hit, never route on a key the node no longer holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdserve.engine.block_keys import BlockKey
from pdserve.engine.kv_events import Medium

DEFAULT_NODE_CAP = 1 << 20
"""Keys kept per node when its pool size is unknown (1M keys: a few hundred MB at worst)."""
DEFAULT_MAX_ENTRIES = 1 << 22
_NONE: set[str] = set()


class KvIndex:
    """key -> nodes holding it, plus each node's keys in insertion order (for dropping and eviction).

    Pool blocks only: the tiers' events and snapshots are ignored (router/kv_tiers.py's
    TieredKvIndex keeps them)."""

    keeps_tiers = False
    """Whether the index keeps the keys of the tiers below the pool (subscribers ask for them)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, node_cap: int = DEFAULT_NODE_CAP) -> None:
        self.max_entries = max_entries
        self.node_cap = node_cap
        self._holders: dict[BlockKey, set[str]] = {}
        self._keys: dict[str, dict[BlockKey, None]] = {}
        self._caps: dict[str, int] = {}
        self._synced: set[str] = set()
        self.size = 0
        self.evicted = 0

    # --- node state -------------------------------------------------------------------------
    def set_capacity(self, node: str, total_blocks: int) -> None:
        """Cap `node`'s keys at its pool size (from its load report); 0 keeps the default cap."""
        self._caps[node] = min(total_blocks, self.node_cap) if total_blocks > 0 else self.node_cap
        self._trim(node)

    def is_synced(self, node: str) -> bool:
        return node in self._synced

    def node_size(self, node: str) -> int:
        return len(self._keys.get(node, ()))

    def nodes(self) -> list[str]:
        return list(self._keys)

    def suspend(self, node: str) -> None:
        """Stop matching `node` (its stream is down) but keep its entries for a resumed stream."""
        self._synced.discard(node)

    def resume(self, node: str) -> None:
        """The resumed stream continued without a gap: match `node` again."""
        if node in self._keys:
            self._synced.add(node)

    def drop(self, node: str) -> None:
        """Forget everything about `node` (restart, removal, unusable, gap): it is cold until synced."""
        self._synced.discard(node)
        for key in self._keys.pop(node, {}):
            self._unhold(key, node)
        self._caps.pop(node, None)

    def replace(self, node: str, keys: Iterable[BlockKey]) -> None:
        """A complete snapshot: `node` holds exactly `keys`, and is synced from now on."""
        cap = self._caps.get(node, self.node_cap)
        self.drop(node)
        self._caps[node] = cap
        self._keys[node] = {}
        self.store(node, keys)
        self._synced.add(node)

    # --- events -----------------------------------------------------------------------------
    def store(self, node: str, keys: Iterable[BlockKey]) -> None:
        mine = self._keys.setdefault(node, {})
        for key in keys:
            if key in mine:
                continue
            mine[key] = None
            self._holders.setdefault(key, set()).add(node)
            self.size += 1
        self._trim(node)

    def store_in(self, node: str, keys: Iterable[BlockKey], medium: Medium) -> None:
        """A STORED event in `medium`."""
        if medium is Medium.POOL:
            self.store(node, keys)

    def remove_from(self, node: str, keys: Iterable[BlockKey], medium: Medium) -> None:
        """A REMOVED event in `medium`."""
        if medium is Medium.POOL:
            self.remove(node, keys)

    def replace_tier(self, node: str, medium: Medium, keys: Iterable[BlockKey]) -> None:
        """A complete snapshot of what `node` holds in the tier `medium`."""

    def remove(self, node: str, keys: Iterable[BlockKey]) -> None:
        mine = self._keys.get(node)
        if mine is None:
            return
        for key in keys:
            if mine.pop(key, 0) is None:  # was held (dict values are None)
                self._unhold(key, node)

    def clear(self, node: str) -> None:
        """The node dropped every block (a CLEARED event); it stays synced."""
        for key in self._keys.get(node, {}):
            self._unhold(key, node)
        if node in self._keys:
            self._keys[node] = {}

    # --- matching ---------------------------------------------------------------------------
    def holders(self, key: BlockKey) -> set[str]:
        """Nodes that hold `key` (synced or not; do not modify)."""
        return self._holders.get(key, _NONE)

    def match(self, keys: Sequence[BlockKey], nodes: Iterable[str]) -> dict[str, int]:
        """For each synced node of `nodes`: how many leading `keys` it holds (0 for the rest).

        A prefix hit needs every earlier block too (the engine stops at the first miss), so a
        node drops out of the running at its first missing key."""
        result = {n: 0 for n in nodes}
        alive = {n for n in result if n in self._synced}
        for depth, key in enumerate(keys):
            if not alive:
                break
            alive &= self._holders.get(key, set())
            for n in alive:
                result[n] = depth + 1
        return result

    # --- bounds -----------------------------------------------------------------------------
    def _unhold(self, key: BlockKey, node: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(node)
            if not holders:
                del self._holders[key]
        self.size -= 1

    def _trim(self, node: str) -> None:
        mine = self._keys.get(node)
        if mine is None:
            return
        over = len(mine) - self._caps.get(node, self.node_cap)
        while over > 0 and mine:
            self._evict_oldest(node)
            over -= 1
        while self.size > self.max_entries:
            largest = max(self._keys, key=lambda n: len(self._keys[n]))
            if not self._keys[largest]:
                break
            self._evict_oldest(largest)

    def _evict_oldest(self, node: str) -> None:
        mine = self._keys[node]
        key = next(iter(mine))
        del mine[key]
        self._unhold(key, node)
        self.evicted += 1
