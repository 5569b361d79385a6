"""Prefill offload: while every prefill node is saturated, a decode node prefills the prompt itself.

Issue 27's profile of `pdserve up` under AIPerf (chat, 128 in / 64 out, concurrency 8, 2 cores):
requests arrive in waves (8 start together, decode together, finish together), and every prompt of a
wave queued at the one prefill process while the decode nodes waited for their KV; then the decode
nodes worked while the prefill node idled (py-spy: its engine thread waited for work about half of
the run). The prefill node already batches (every prompt waiting when a step starts joins it, up to
8192 tokens), but a step over 8 prompts still costs several times one prompt's compute, so the last
prompt of a wave waited for the whole wave. Spreading a wave's prompts over the prefill node and the
idle decode nodes puts more processes on it at once: TTFT p50 fell from ~14 s to ~3 s and p99 from
16-20 s to 6-7 s on that (heavily shared) machine; see docs/benchmark-log.md.

The rule (`OffloadPolicy.decide`), in prompt tokens that are still to be computed:

- `queue` is the least loaded prefill node's pending tokens: the prompt tokens this router sent it
  whose first token has not come back yet (`NodeLoad.prefilling_tokens`, counted by `Prefilling`).
  Load reports are not used: one taken while a long prompt was in flight would still say "saturated"
  half a refresh after it finished, and offload the next request for nothing. With several routers
  each sees only its own requests, so it offloads less, never more;
- `local` is the same for the chosen decode node (the prompts it was sent to prefill itself);
- the decode node prefills locally when `queue >= saturated_tokens` and `local + prompt <= queue`:
  the prompt would start no later there, counting its own length against the decode node, because a
  local prefill also holds up the decode node's running streams (one longer step for each of them).

`saturated_tokens` 0 turns offloading off: every prompt goes to a prefill node (the behaviour before).

With a TPOT SLO (`--tpot-slo`, the planner's flag, which the router then also uses here) a decode node
takes a prompt only if the pause it makes (its pending local prompt tokens plus this one, at its
measured prefill rate, or the prefill nodes' while it has none) leaves every stream it serves within
the SLO (router/stream_pace.py); else the prompt waits for a prefill node. On the `disagg` goodput
workload (800-token prompts, 48 out, TPOT <= 0.25 s; 1 prefill + 1 decode node, one core each) the
offload without it missed TPOT on the decode node's streams long before TTFT
(docs/benchmark-log.md, "TPOT-guarded offload").
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass

from pdserve.router.balancer import NodeLoad

DEFAULT_SATURATED_TOKENS = 256
"""About two prompts of the benchmark's 128-token chats (`benchmarks/serve_vs_vllm.py`'s workload, on
which it was set): a prefill node with a longer queue than this is saturated (a wave of 8 then
splits about 3 / 3 / 2 between the prefill and two decode nodes). Checked on a second workload (512
in, 32 out, 4 in flight; BENCHMARKS.md): the best of 0, 256 and 1024 there too."""


def pending_tokens(node: NodeLoad) -> int:
    """Prompt tokens this router sent `node` to prefill whose first token has not come back yet."""
    return node.prefilling_tokens


class Prefilling:
    """One request's prompt, counted on the node that prefills it from routing until its first token
    (or the end of the attempt, whichever comes first); the node's `prefill_rate` learns from the
    prompts that got their first token. `first_token` and `done` are idempotent."""

    def __init__(self, node: NodeLoad, tokens: int) -> None:
        self.node, self.tokens = node, tokens
        node.prefill_rate.started(time.monotonic())
        node.prefilling_tokens += tokens

    def first_token(self) -> None:
        """The prompt is computed: its tokens leave the node's queue and count towards its rate."""
        self._leave(computed=True)

    def done(self) -> None:
        """The attempt ended (if no first token came, nothing is measured)."""
        self._leave(computed=False)

    def __del__(self) -> None:
        # a route that was chosen but never run (its client left first) gives its tokens back
        with contextlib.suppress(Exception):  # e.g. at interpreter exit: nothing left to count
            self._leave(computed=False)

    def _leave(self, computed: bool) -> None:
        if self.tokens:
            self.node.prefilling_tokens -= self.tokens
            idle = self.node.prefilling_tokens <= 0
            self.node.prefill_rate.finished(self.tokens, time.monotonic(), idle, computed)
            self.tokens = 0


class Offload(enum.Enum):
    """An offload decision: where a prompt is prefilled."""

    REMOTE = "remote"
    """On a prefill node (none saturated, offloading off, or the decode node's queue is longer)."""
    LOCAL = "local"
    """On its decode node: every prefill node is saturated."""
    HELD = "held"
    """On a prefill node although every one is saturated: the pause would push the decode node's
    streams past --tpot-slo."""


@dataclass(frozen=True)
class OffloadPolicy:
    """When a decode node should prefill a prompt itself instead of asking a prefill node."""

    saturated_tokens: int = DEFAULT_SATURATED_TOKENS
    """Pending prompt tokens at which a prefill node counts as saturated (0: never offload)."""
    tpot_slo: float | None = None
    """Seconds per output token a decode node's streams must stay within for it to take a prompt
    (None: no such check)."""

    def __post_init__(self) -> None:
        if self.saturated_tokens < 0:
            raise ValueError(f"--prefill-saturated-tokens must be >= 0, got {self.saturated_tokens}")
        if self.tpot_slo is not None and not self.tpot_slo > 0:
            raise ValueError(f"--tpot-slo must be > 0 seconds, got {self.tpot_slo}")

    def decide(
        self, prefills: list[NodeLoad], decode: NodeLoad, prompt_tokens: int, now: float | None = None
    ) -> Offload:
        """Where this prompt is prefilled (see the module doc): REMOTE when offloading is off or there
        is no prefill node (the decode node prefills then anyway), HELD when only the TPOT SLO keeps
        it off `decode`."""
        if self.saturated_tokens == 0 or not prefills:
            return Offload.REMOTE
        queue = min(pending_tokens(n) for n in prefills)
        if queue < self.saturated_tokens or pending_tokens(decode) + prompt_tokens > queue:
            return Offload.REMOTE
        if self.tpot_slo is not None and not self.keeps_tpot(prefills, decode, prompt_tokens, now):
            return Offload.HELD
        return Offload.LOCAL

    def keeps_tpot(self, prefills: list[NodeLoad], decode: NodeLoad, prompt_tokens: int, now: float | None) -> bool:
        """Whether prefilling `prompt_tokens` more on `decode` leaves its streams within the TPOT SLO.
        True while no rate is measured yet (the pause cannot be estimated; the first offloads measure it)."""
        assert self.tpot_slo is not None
        rate = decode.prefill_rate.tokens_per_second
        if rate is None:  # not measured on this node yet: a prefill node's, on like hardware
            rates = [r for n in prefills if (r := n.prefill_rate.tokens_per_second) is not None]
            rate = max(rates, default=None)
        if rate is None:
            return True
        pause = (pending_tokens(decode) + prompt_tokens) / rate
        return decode.streams.worst_tpot_after(pause, now) <= self.tpot_slo

    @staticmethod
    def assign_local(decode: NodeLoad, prompt_tokens: int) -> None:
        """Count a prompt sent to `decode` to prefill in its load until its next report includes it
        (kv-aware routing weighs a decode node's own prefill queue)."""
        decode.inflight_tokens += prompt_tokens
