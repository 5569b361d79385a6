"""TieredKvIndex: the router's KvIndex of pool blocks, plus where else each node's blocks live.

Nodes with a host tier (--kv-offloading-size) or a shared store (--kv-store) report those
blocks' keys too (KvEvents with `tiers`, each event naming its medium). A prefix a node has to
restore from its host tier is cheaper than one it recomputes, and dearer than one in its pool; a
block in the shared store can be restored by every node with the same KV compatibility (the keys
are rooted on it), whichever node wrote it. `match_tiers` walks a prompt's keys once per node and
counts, in the leading run every block of which the node can get without computing it, the
blocks in its pool, in its host tier and in the store; the policy prices them (kv_policy).

State follows the pool index: a node is matched only while its stream is synced, and a node that
is dropped (restart, gap, removal) loses its tier entries with its pool entries, including the
store keys it reported, so the store's entries are only as fresh as the streams that carried
them. Each tier is bounded like the pool index (per node and in all); forgetting a key can only
under-estimate a hit. A stale store entry (evicted by another node's writes) costs one routing
decision a recompute, never a wrong output: the node looks the block up before it uses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pdserve.engine.block_keys import BlockKey
from pdserve.engine.kv_events import Medium
from pdserve.router.kv_index import DEFAULT_MAX_ENTRIES, DEFAULT_NODE_CAP, KvIndex

TIERS = (Medium.HOST, Medium.STORE)


class TierHits(NamedTuple):
    """Leading prompt blocks a node can have without computing them, by where they are."""

    pool: int = 0
    host: int = 0
    store: int = 0

    @property
    def total(self) -> int:
        return self.pool + self.host + self.store


POOL_NAMES = ("", "cpu", "gpu", "pool")
"""How a pool's medium is named on the wire: by its device (an older node says nothing)."""


def medium_of(wire: str) -> Medium | None:
    """A KvEvent's or snapshot chunk's medium: "host" and "store" are tiers, the pool is named by
    its device; None for a medium this router does not know (a newer node's tier): its keys are
    not taken for the pool's, which would over-count that node's hits."""
    if wire in TIERS:
        return Medium(wire)
    return Medium.POOL if wire in POOL_NAMES else None


class TieredKvIndex(KvIndex):
    """The pool's keys (this KvIndex) and each node's host-tier and store keys (one KvIndex each)."""

    keeps_tiers = True

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, node_cap: int = DEFAULT_NODE_CAP) -> None:
        super().__init__(max_entries, node_cap)
        self.tiers = {m: KvIndex(max_entries, node_cap) for m in TIERS}

    # --- node state follows the pool's ----------------------------------------------------
    def drop(self, node: str) -> None:
        super().drop(node)
        for tier in self.tiers.values():
            tier.drop(node)

    def replace_tier(self, node: str, medium: Medium, keys: Iterable[BlockKey]) -> None:
        self.tiers[medium].replace(node, keys)

    def store_in(self, node: str, keys: Iterable[BlockKey], medium: Medium) -> None:
        if medium is Medium.POOL:
            self.store(node, keys)
        else:
            self.tiers[medium].store(node, keys)

    def remove_from(self, node: str, keys: Iterable[BlockKey], medium: Medium) -> None:
        if medium is Medium.POOL:
            self.remove(node, keys)
        else:
            self.tiers[medium].remove(node, keys)

    # --- matching ---------------------------------------------------------------------------
    def match_tiers(self, keys: Sequence[BlockKey], node: str) -> TierHits:
        """Where `node` would get each leading key from: its pool, its host tier, else the store
        (reported by any synced node); the run ends at the first key in none of them. Nothing for a
        node that is not synced."""
        if not self.is_synced(node):
            return TierHits()
        host, store = self.tiers[Medium.HOST], self.tiers[Medium.STORE]
        counts = {Medium.POOL: 0, Medium.HOST: 0, Medium.STORE: 0}
        for key in keys:
            if node in self.holders(key):
                counts[Medium.POOL] += 1
            elif node in host.holders(key):
                counts[Medium.HOST] += 1
            elif any(self.is_synced(n) for n in store.holders(key)):
                counts[Medium.STORE] += 1
            else:
                break
        return TierHits(counts[Medium.POOL], counts[Medium.HOST], counts[Medium.STORE])
