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

A stream's end is forecast as the time it has taken so far, plus the pause, plus its remaining tokens
at the node's decode step: the median gap between tokens over the node's recent tokens, which a
pause (one long gap among many short ones) does not move. Forecasting the remaining tokens at the
stream's own pace so far instead counted a pause once for every token left: a stream whose second
token came after a 1.5 s pause looked 1.5 s a token slow, and the router kept prompts off a decode
node whose streams ended near 0.08 s a token (docs/benchmark-log.md, "TPOT-guarded offload").
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

RECENT_GAPS = 64
"""Token gaps the node's step time is the median of (a few steps of a full batch, or the last
couple of seconds of one stream)."""


@dataclass
class Stream:
    """One attempt streaming from a decode node: when its first and latest tokens came, how many."""

    max_tokens: int
    """The most tokens this attempt may produce (its request's max_tokens less those already sent)."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    tokens: int = 0

    def tpot_after(self, pause: float, step: float, now: float) -> float:
        """Its TPOT at the end if the node pauses `pause` seconds now and then produces its remaining
        tokens `step` seconds apart. Before its first token a pause delays that token (its TTFT),
        not its TPOT."""
        gaps = max(self.max_tokens - 1, 1)
        if self.first_token_at is None:
            return step
        remaining = max(self.max_tokens - self.tokens, 0)
        return (now - self.first_token_at + pause + remaining * step) / gaps


@dataclass
class Streams:
    """The streams one decode node serves for this router (a node's `NodeLoad.streams`), and the
    gaps between the tokens they received."""

    _by_id: dict[int, Stream] = field(default_factory=dict)
    _gaps: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_GAPS))

    def open(self, max_tokens: int) -> Stream:
        stream = Stream(max_tokens)
        self._by_id[id(stream)] = stream
        return stream

    def close(self, stream: Stream) -> None:
        self._by_id.pop(id(stream), None)

    def __len__(self) -> int:
        return len(self._by_id)

    def arrived(self, stream: Stream, count: int, now: float) -> None:
        """`count` tokens of `stream` came back at `now` (an event may carry several)."""
        if count <= 0:
            return
        if stream.last_token_at is None:
            stream.first_token_at = now
        else:
            self._gaps.extend([(now - stream.last_token_at) / count] * min(count, RECENT_GAPS))
        stream.last_token_at = now
        stream.tokens += count

    @property
    def step(self) -> float:
        """Seconds between two tokens of a stream on this node: the median recent gap (0 before any)."""
        return statistics.median(self._gaps) if self._gaps else 0.0

    def worst_tpot_after(self, pause: float, now: float | None = None) -> float:
        """The highest end-of-stream TPOT a `pause`-second pause now would leave among the node's
        streams (0.0 when it serves none). A stream already past the SLO counts too: letting the
        pauses go on once one stream is late was measured worse (docs/benchmark-log.md)."""
        now = time.monotonic() if now is None else now
        step = self.step
        return max((s.tpot_after(pause, step, now) for s in self._by_id.values()), default=0.0)
