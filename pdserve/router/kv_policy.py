"""KV-aware routing policy: pure functions from what the router knows of each node to a choice.

Decode: cost = miss_weight x (prompt blocks the node lacks) + load_weight x (its active decode
blocks), as in Dynamo's KV router. The cheapest nodes form a shortlist; the caller's WRR on free
KV picks among them, so ties and cold prompts (no node holds any of the prompt) are placed as
`--routing wrr` would place them.

No hot-spots: a prefix every request shares (a system prompt) makes its holder the cheapest
for everyone. A node whose load exceeds (1 + balance_eps) x the mean (+ `slack`, so that
nearly idle nodes are never skipped) is left out unless every node is; and with probability
`explore` the cache is ignored altogether (WRR), so new nodes warm up and scores stay honest.

Prefill: cost = tokens the prefill node must compute (prompt minus its cached prefix) + its
queued prefill tokens, with the same bound on queued tokens.

Tiers: a node's leading prompt blocks it does not hold in its pool but can restore (its host
tier, the shared store) are not misses; each costs host_weight or store_weight instead, so a hit
is priced by where it lives: pool < host < store < recompute.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyParams:
    """Weights of the routing cost (docs/routing.md, "KV-aware routing")."""

    miss_weight: float = 1.0
    """Cost of one prompt block the node lacks (it must be prefilled and shipped)."""
    load_weight: float = 0.01
    """Cost of one block of active decode load on the node. Small: a decoding request delays a
    new prompt far less than a block to prefill does, but it still separates equal nodes
    (tuned with benchmarks/trace_replay.py; 1.0 there cost all of the TTFT gain)."""
    queue_weight: float = 0.1
    """Cost of one block of prompt the node has queued to prefill itself (local prefill: work
    ahead of this request's first token). Below the miss weight: a miss also costs the hits of
    the conversation's later turns, which a short queue does not (tuned like load_weight)."""
    balance_eps: float = 0.25
    """Hot-spot bound: skip nodes whose load exceeds (1 + eps) x the mean load."""
    explore: float = 0.01
    """Fraction of warm requests routed by WRR alone."""
    tie_tolerance: float = 0.0
    """Costs within this much of the best count as ties (WRR decides among them)."""
    host_weight: float = 0.1
    """Cost of one prompt block the node restores from its host tier (a copy in host memory). Set
    by the order of the media's costs (pool < host < store < recompute), not tuned on a workload."""
    store_weight: float = 0.3
    """Cost of one prompt block the node restores from the shared store (a read over the network or
    from a file, then a checksum). Set like host_weight, not tuned."""


@dataclass(frozen=True)
class Candidate:
    """One node as the policy sees it."""

    address: str
    overlap: int
    """Leading prompt blocks the node holds or can restore (from the KV index), tiers included."""
    load: float
    """Decode: load_weight x active blocks + queue_weight x queued prefill blocks. Prefill: queued tokens."""
    host: int = 0
    """Of `overlap`, blocks in the node's host tier (restored, not computed)."""
    store: int = 0
    """Of `overlap`, blocks in the shared store."""

    def restore_cost(self, p: PolicyParams) -> float:
        """What restoring the tiers' blocks costs, in blocks of miss."""
        return p.host_weight * self.host + p.store_weight * self.store


@dataclass(frozen=True)
class Decision:
    """The shortlist to pick from (WRR among them) and why it was made."""

    addresses: list[str]
    reason: str
    """cold | cache | tie | balance | explore (the metric label)."""


def within_bound(cands: list[Candidate], eps: float, slack: float) -> list[Candidate]:
    """Candidates whose load is at most (1 + eps) x the mean + slack; all of them if none is."""
    if not cands:
        return []
    mean = sum(c.load for c in cands) / len(cands)
    ok = [c for c in cands if c.load <= (1 + eps) * mean + slack]
    return ok or cands


def decode_cost(c: Candidate, prompt_blocks: int, p: PolicyParams) -> float:
    return p.miss_weight * max(prompt_blocks - c.overlap, 0) + c.restore_cost(p) + c.load


def choose_decode(
    cands: list[Candidate], prompt_blocks: int, p: PolicyParams, rng: random.Random, slack: float = 0.0
) -> Decision:
    """Shortlist of decode nodes for a prompt of `prompt_blocks` full blocks.

    `slack` (in load units; the caller passes the request's own blocks) keeps the bound from
    skipping a node that differs from the mean by about one request."""
    if not cands:
        return Decision([], "cold")
    if all(c.overlap == 0 for c in cands):
        return Decision([c.address for c in cands], "cold")
    bounded = within_bound(cands, p.balance_eps, slack)
    if rng.random() < p.explore:
        return Decision([c.address for c in bounded], "explore")
    costs = {c.address: decode_cost(c, prompt_blocks, p) for c in bounded}
    best = min(costs.values())
    short = [a for a, cost in costs.items() if cost <= best + p.tie_tolerance]
    unbounded_best = min(cands, key=lambda c: decode_cost(c, prompt_blocks, p))
    if unbounded_best.address not in costs:
        reason = "balance"  # the cheapest node was skipped as a hot-spot
    else:
        reason = "tie" if len(short) > 1 else "cache"
    return Decision(short, reason)


def order_prefill(
    cands: list[Candidate], prompt_tokens: int, block_size: int, p: PolicyParams, slack: float = 0.0
) -> tuple[list[str], str]:
    """Prefill nodes best first (the first is the choice, the rest fallbacks), and the reason.

    Cost in tokens: what the node must compute (its cached prefix is free) + its queue."""
    if not cands:
        return [], "cold"

    def cost(c: Candidate) -> float:
        return max(prompt_tokens - c.overlap * block_size, 0) + c.restore_cost(p) * block_size + c.load

    bounded = {c.address for c in within_bound(cands, p.balance_eps, slack)}
    ranked = sorted(cands, key=lambda c: (c.address not in bounded, cost(c)))
    if all(c.overlap == 0 for c in cands):
        reason = "cold"
    elif min(cands, key=cost).address != ranked[0].address:
        reason = "balance"
    else:
        reason = "cache"
    return [c.address for c in ranked], reason
