"""KvRouter: the KV-aware choice of decode and prefill nodes, shared by the router and the trace replay.

It turns a prompt into block keys (per KV compatibility: nodes with equal compatibility share
keys, so they are hashed once), asks the index how many leading blocks each node holds in its
pool or can restore from a tier below it (router/kv_tiers.py), lets
the pure policy (router/kv_policy.py) shortlist, and lets the existing balancers pick among the
shortlist, so ties and cold prompts are placed exactly as `--routing wrr` places them. It also
counts what it did (decisions by reason, prefix hits per node) for the metrics collector.
"""

from __future__ import annotations

import enum
import random
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from pdserve.engine.block_keys import BlockKey, namespace_root, prompt_block_keys
from pdserve.router.balancer import DecodeBalancer, NodeLoad, PrefillBalancer
from pdserve.engine.kv_events import Medium
from pdserve.router.kv_index import KvIndex
from pdserve.router.kv_policy import Candidate, PolicyParams, choose_decode, order_prefill
from pdserve.router.kv_tiers import TieredKvIndex, TierHits


class Routing(enum.StrEnum):
    """How the router picks nodes (`--routing`; members equal their strings)."""

    KV_AWARE = "kv-aware"
    """By the blocks each node holds, then load (KvRouter)."""
    WRR = "wrr"
    """By load alone: smooth weighted round robin on free decode memory."""


ROUTING_MODES = tuple(r.value for r in Routing)


class DecodeChoice(NamedTuple):
    """A decode node for one request, and what it lacks of the prompt."""

    node: NodeLoad
    uncached_tokens: int
    """The prompt tokens the node does not hold: what it computes if it prefills the prompt itself
    (the caller counts them in its load, `OffloadPolicy.assign_local`)."""


class PrefillOrder(NamedTuple):
    """Prefill nodes for one request, best first, and what each holds of the prompt."""

    nodes: list[NodeLoad]
    cached_tokens: dict[str, int]
    """Leading prompt tokens each node held (by the index), by address: sent to the decode node,
    which then offers no D->P pull a prefill node does not need."""


class KvRouter:
    """Chooses nodes by KV overlap + load; `index` is fed by KvSubscribers or a simulator."""

    def __init__(
        self,
        index: KvIndex | None = None,
        params: PolicyParams | None = None,
        seed: int | None = None,
        decode_balancer: DecodeBalancer | None = None,
        prefill_balancer: PrefillBalancer | None = None,
    ) -> None:
        self.index = index or TieredKvIndex()
        self.params = params or PolicyParams()
        self.rng = random.Random(seed)
        self.decode_balancer = decode_balancer or DecodeBalancer()
        self.prefill_balancer = prefill_balancer or PrefillBalancer()
        self.decisions: Counter[tuple[str, str]] = Counter()
        """(role, reason) -> routing decisions."""
        self.hit_blocks: Counter[tuple[str, str]] = Counter()
        """(role, address) -> prompt blocks the chosen node held at routing time."""
        self.hit_tokens: Counter[tuple[str, str]] = Counter()
        self.tier_hit_blocks: Counter[tuple[str, Medium]] = Counter()
        """(role, medium) -> prompt blocks the chosen node was to restore from a tier below its pool."""

    def tier_hits(self, nodes: list[NodeLoad], prompt: Sequence[int], cache_salt: str | None) -> dict[str, TierHits]:
        """Leading blocks of `prompt` each node holds in its pool or can restore, by medium (the block
        of the last token never counts: the engine always computes it, for the logits)."""
        keys_by_compat: dict[tuple[str, int], list[BlockKey]] = {}
        result: dict[str, TierHits] = {}
        for n in nodes:
            compat = (n.compatibility, n.block_size)
            if compat not in keys_by_compat:
                limit = max(len(prompt) - 1, 0) // n.block_size
                root = namespace_root(n.compatibility, cache_salt)
                keys_by_compat[compat] = prompt_block_keys(root, prompt, n.block_size, limit)
            keys = keys_by_compat[compat]
            if isinstance(self.index, TieredKvIndex):
                result[n.address] = self.index.match_tiers(keys, n.address)
            else:
                result[n.address] = TierHits(self.index.match(keys, [n.address])[n.address])
        return result

    def overlaps(self, nodes: list[NodeLoad], prompt: Sequence[int], cache_salt: str | None) -> dict[str, int]:
        """Leading blocks of `prompt` each node holds or can restore (`tier_hits`' totals)."""
        return {a: h.total for a, h in self.tier_hits(nodes, prompt, cache_salt).items()}

    def choose_decode(
        self, nodes: list[NodeLoad], prompt: Sequence[int], cache_salt: str | None, tokens_needed: int, now: float
    ) -> DecodeChoice | None:
        """The decode node for a request needing `tokens_needed` tokens of KV (None: no room)."""
        fits = [n for n in nodes if n.report_time is None or n.effective_free >= n.blocks_for(tokens_needed)]
        if not fits:
            return None
        hits = self.tier_hits(fits, prompt, cache_salt)
        overlap = {a: h.total for a, h in hits.items()}
        cands = [
            Candidate(n.address, overlap[n.address], self.decode_load(n), hits[n.address].host, hits[n.address].store)
            for n in fits
        ]
        prompt_blocks = max(len(prompt) - 1, 0) // fits[0].block_size
        p = self.params
        slack = p.load_weight * fits[0].blocks_for(tokens_needed) + p.queue_weight * prompt_blocks  # one request
        decision = choose_decode(cands, prompt_blocks, p, self.rng, slack=slack)
        short = [n for n in fits if n.address in decision.addresses]
        chosen = self.decode_balancer.pick(short, tokens_needed, now)
        if chosen is None:
            return None
        # the prompt tokens it prefills itself, if any, are counted by the caller (router.prefill_offload)
        self._count("decode", decision.reason, chosen, hits[chosen.address])
        return DecodeChoice(chosen, max(len(prompt) - overlap[chosen.address] * chosen.block_size, 0))

    def decode_load(self, n: NodeLoad) -> float:
        """Active decode blocks + prompt blocks the node has queued to prefill itself, weighted."""
        queued_blocks = (n.queued_prefill_tokens + n.inflight_tokens) / n.block_size
        return self.params.load_weight * used_blocks(n) + self.params.queue_weight * queued_blocks

    def order_prefill(self, nodes: list[NodeLoad], prompt: Sequence[int], cache_salt: str | None) -> PrefillOrder:
        """Prefill nodes best first: least (uncached prompt tokens + queued tokens)."""
        if not nodes:
            return PrefillOrder([], {})
        hits = self.tier_hits(nodes, prompt, cache_salt)
        overlap = {a: h.total for a, h in hits.items()}
        # overlap in tokens (block size 1 below): nodes may differ in block size
        cands = [
            Candidate(
                n.address,
                overlap[n.address] * n.block_size,
                n.queued_prefill_tokens + n.inflight_tokens,
                hits[n.address].host * n.block_size,
                hits[n.address].store * n.block_size,
            )
            for n in nodes
        ]
        ranked, reason = order_prefill(cands, len(prompt), 1, self.params, slack=len(prompt))
        if reason == "cold":
            ordered = self.prefill_balancer.order(nodes)  # as --routing wrr: least queued, ties round robin
        else:
            by_address = {n.address: n for n in nodes}
            ordered = [by_address[a] for a in ranked]
        first = ordered[0]
        self._count("prefill", reason, first, hits[first.address])
        first.inflight_tokens += max(len(prompt) - overlap[first.address] * first.block_size, 0)
        return PrefillOrder(ordered, {n.address: overlap[n.address] * n.block_size for n in nodes})

    def _count(self, role: str, reason: str, node: NodeLoad, hits: TierHits) -> None:
        self.decisions[(role, reason)] += 1
        self.hit_blocks[(role, node.address)] += hits.pool
        self.hit_tokens[(role, node.address)] += hits.pool * node.block_size
        self.tier_hit_blocks[(role, Medium.HOST)] += hits.host
        self.tier_hit_blocks[(role, Medium.STORE)] += hits.store


def used_blocks(n: NodeLoad) -> int:
    """Active decode load: blocks held by requests (reported) + blocks sent since the report."""
    if n.report_time is None:
        return 0
    return max(n.total_blocks - n.effective_free, 0)
