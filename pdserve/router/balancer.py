"""Choosing nodes: smooth weighted round robin on free decode KV, least queued prefill tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.block_manager import blocks_for
from pdserve.router.saturation import PrefillRate
from pdserve.router.stream_pace import Streams


@dataclass
class NodeLoad:
    """What the balancer knows of one node (updated from its load reports)."""

    address: str
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 16
    queued_prefill_tokens: int = 0
    report_time: float | None = None
    """monotonic time of the last load report (None: never reported)."""
    inflight_blocks: int = 0
    """Blocks of requests sent since the last report (so a node just chosen is not stampeded)."""
    inflight_tokens: int = 0
    """Prompt tokens sent to this prefill node since its last report."""
    prefilling_tokens: int = 0
    """Prompt tokens this router sent to this node to prefill whose first token has not come back yet
    (exact for this router's requests, unlike a load report that may be half a refresh old)."""
    prefill_rate: PrefillRate = field(default_factory=PrefillRate)
    """Prompt tokens per second this node's prefill path has sustained (router/saturation.py)."""
    streams: Streams = field(default_factory=Streams)
    """A decode node's streams for this router, with their pace (router/stream_pace.py)."""
    current_weight: float = 0.0
    compatibility: str = ""
    """The node's KV compatibility string (its block keys' namespace)."""

    @property
    def effective_free(self) -> int:
        return self.free_blocks - self.inflight_blocks

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.block_size)

    def report(
        self, free_blocks: int, total_blocks: int, block_size: int, queued: int, now: float, compatibility: str = ""
    ) -> None:
        self.free_blocks, self.total_blocks, self.block_size = free_blocks, total_blocks, block_size
        self.compatibility = compatibility
        self.queued_prefill_tokens = queued
        self.report_time = now
        self.inflight_blocks = self.inflight_tokens = 0


class DecodeBalancer:
    """Smooth weighted round robin (nginx's algorithm) with free KV blocks as weights.

    Each pick adds every candidate's weight to its current weight, takes the
    largest, and subtracts the total from the winner: picks follow the weights
    and interleave smoothly instead of bursting. Nodes that cannot fit the
    request are skipped. When fewer than `fresh_fraction` of the nodes have a
    report younger than `fresh_seconds`, weights are stale and it falls back to
    plain round robin.
    """

    def __init__(self, fresh_seconds: float = 3.0, fresh_fraction: float = 0.8) -> None:
        self.fresh_seconds = fresh_seconds
        self.fresh_fraction = fresh_fraction
        self._rr = 0

    def pick(self, nodes: list[NodeLoad], tokens_needed: int, now: float) -> NodeLoad | None:
        if not nodes:
            return None
        fresh = [n for n in nodes if n.report_time is not None and now - n.report_time <= self.fresh_seconds]
        fits = [n for n in nodes if n.report_time is None or n.effective_free >= n.blocks_for(tokens_needed)]
        if not fits:
            return None
        if len(fresh) < self.fresh_fraction * len(nodes):
            self._rr += 1
            return fits[self._rr % len(fits)]
        weighted = [n for n in fits if n in fresh]
        if not weighted:
            return None
        total = 0.0
        for n in weighted:
            w = max(n.effective_free, 0)
            n.current_weight += w
            total += w
        best = max(weighted, key=lambda n: n.current_weight)
        best.current_weight -= total
        return best

    @staticmethod
    def assign(node: NodeLoad, tokens_needed: int) -> None:
        node.inflight_blocks += node.blocks_for(tokens_needed)


class PrefillBalancer:
    """Least queued prefill tokens (reported + sent since the report); ties go round robin."""

    def __init__(self) -> None:
        self._rr = 0

    def order(self, nodes: list[NodeLoad]) -> list[NodeLoad]:
        """Nodes best first (the first is the choice, the rest are fallbacks)."""
        if not nodes:
            return []
        key = lambda n: n.queued_prefill_tokens + n.inflight_tokens  # noqa: E731
        ranked = sorted(nodes, key=key)
        ties = [n for n in ranked if key(n) == key(ranked[0])]
        self._rr += 1
        first = ties[self._rr % len(ties)]
        return [first] + [n for n in ranked if n is not first]
