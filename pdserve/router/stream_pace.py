"""Stream pace: the time per output token of each stream a decode node is serving, as the router
sees its tokens come back, and what a pause of that node would do to it.

A decode node that prefills a prompt itself (the router's offload, router/prefill_offload.py) stops
decoding for as long as the prompt takes, and every stream it serves gets that pause on its time per
output token (TPOT): one 800-token prompt on one core is about 1.5 s, against a decode step of tens
of ms. Offloading is worth it while prefill nodes are saturated and TPOT has room, and not once a
pause would push the node's streams past the TPOT SLO: then the prompt waits for a prefill node
instead, and its TTFT, not every running stream's TPOT, pays. `Streams.worst_tpot_after` is that
check, in the terms of the TPOT that clients and AIPerf measure: (last token - first token) /
(output tokens - 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Stream:
    """One attempt streaming from a decode node: when its first token came and how many since."""

    max_tokens: int
    """The most tokens this attempt may produce (its request's max_tokens less those already sent)."""
    first_token_at: float | None = None
    tokens: int = 0

    def arrived(self, count: int, now: float) -> None:
        """`count` tokens came back at `now`."""
        if count <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
        self.tokens += count

    def tpot_after(self, pause: float, now: float) -> float:
        """Its TPOT at the end if the node pauses `pause` seconds now and the tokens it has still to
        produce come at its pace so far: pace + pause / (max_tokens - 1). The pace so far counts the
        pauses it already had, so a stream slowed by earlier offloads is the first to refuse more.
        Before its second token its pace is unknown and taken as 0 (only the pause counts)."""
        gaps = max(self.max_tokens - 1, 1)
        pace = 0.0
        if self.first_token_at is not None and self.tokens > 1:
            pace = (now - self.first_token_at) / (self.tokens - 1)
        return pace + pause / gaps


@dataclass
class Streams:
    """The streams one decode node serves for this router (a node's `NodeLoad.streams`)."""

    _by_id: dict[int, Stream] = field(default_factory=dict)

    def open(self, max_tokens: int) -> Stream:
        stream = Stream(max_tokens)
        self._by_id[id(stream)] = stream
        return stream

    def close(self, stream: Stream) -> None:
        self._by_id.pop(id(stream), None)

    def __len__(self) -> int:
        return len(self._by_id)

    def worst_tpot_after(self, pause: float, now: float | None = None) -> float:
        """The highest end-of-stream TPOT a `pause`-second pause now would leave among the node's
        streams (0.0 when it serves none). A stream already past the SLO counts too: letting the
        pauses go on once one stream is late was measured worse (docs/benchmark-log.md, "TPOT-guarded
        offload"), as a pace of a few tokens is a noisy forecast."""
        now = time.monotonic() if now is None else now
        return max((s.tpot_after(pause, now) for s in self._by_id.values()), default=0.0)
