"""Saturation: how many seconds of prompt work a node already has queued, and when that is too much.

Under overload the waiting must happen in one place, the router's admission queue, where it is
bounded (`--capacity-wait`, `--max-waiting-requests`) and a request that cannot be served is refused
before any work. Without a bound here the router would hand every arrival to a node as long as the
node had KV room: a 3x burst of 60 s put about 160 s of prompts in the nodes' queues, so the last
requests waited minutes for a first token, past the router's per-attempt deadlines. A retry after
such a deadline recomputes everything and fails halfway, which is what overload must never do.

The bound is in seconds, not tokens, so one default fits a 2-core CPU and a GPU alike:

- `PrefillRate` measures the prompt tokens per second a node's prefill path has sustained while it
  had work: each prompt's tokens when its first token comes back, over the time the node had prompts
  pending (decayed, so it follows a node that gets slower or faster);
- a node's backlog is its pending prompt tokens (`NodeLoad.prefilling_tokens`, this router's exact
  count) over that rate; a node whose backlog is `max_prefill_backlog` seconds or more takes no new
  prompt until it drains. A node with nothing pending is never saturated; one not yet measured
  takes one prompt at a time until the first comes back.
"""

from __future__ import annotations

import math

BACKLOG_SHARE = 0.25
"""The default `--max-prefill-backlog` as a share of `--first-token-timeout` (30 s of 120 s): an
admitted request's first token comes far inside its deadline."""


class PrefillRate:
    """Prompt tokens per second a node's prefill path sustains while it has prompts pending.

    Both sums decay with busy time, not per prompt: a node that batches finishes many prompts at
    one instant after one long step, and a per-prompt decay would forget that step's time after a
    few of them and report a rate many times too high."""

    HALF_LIFE = 10.0
    """Seconds of busy time after which a measurement counts half."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seconds = 0.0
        self._busy_since: float | None = None

    def started(self, now: float) -> None:
        """A prompt was sent to the node; its busy time runs from the first one pending."""
        if self._busy_since is None:
            self._busy_since = now

    def finished(self, tokens: int, now: float, idle: bool, computed: bool) -> None:
        """A prompt left the node's queue at `now`: its first token came back (`computed`), or its
        attempt ended without one (then nothing is measured, and the time since the last prompt
        computed keeps counting towards the next one). `idle`: no prompt of this router is pending
        on the node any more (the time until the next one arrives is not busy time)."""
        if computed and self._busy_since is not None:
            elapsed = max(0.0, now - self._busy_since)
            keep = 0.5 ** (elapsed / self.HALF_LIFE)
            self.tokens = self.tokens * keep + tokens
            self.seconds = self.seconds * keep + elapsed
            self._busy_since = now
        if idle:
            self._busy_since = None

    @property
    def tokens_per_second(self) -> float | None:
        """None until a prompt has been measured."""
        if self.seconds <= 0.0 or self.tokens <= 0.0:
            return None
        return self.tokens / self.seconds


def check_max_backlog(seconds: float, first_token_timeout: float) -> float:
    """`seconds` when it is a valid --max-prefill-backlog, else ValueError naming the flags: an
    admitted prompt must be able to get its first token inside --first-token-timeout."""
    if seconds < 0:
        raise ValueError(f"--max-prefill-backlog must be >= 0 (0: no bound), got {seconds}")
    if seconds >= first_token_timeout:
        raise ValueError(
            f"--max-prefill-backlog ({seconds:g} s) must be below --first-token-timeout ({first_token_timeout:g} s): "
            "a prompt admitted behind that much work would time out"
        )
    return seconds


def backlog_seconds(pending_tokens: int, rate: PrefillRate) -> float:
    """Seconds the node needs for the prompts pending on it: 0 when none is; infinite while one is
    but no prompt of the node's has been measured yet (an unmeasured node takes one prompt at a
    time until its first one comes back, so a cold burst cannot all land on it)."""
    if pending_tokens <= 0:
        return 0.0
    speed = rate.tokens_per_second
    return pending_tokens / speed if speed else math.inf
