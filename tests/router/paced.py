"""A fake cluster whose tokens come at a chosen pace, for streaming and connection tests."""

from __future__ import annotations

import asyncio

from pdserve.v1 import common_pb2, decode_pb2


class PacedCluster:
    """Yields one token per chunk, `pace` seconds apart, after `first_delay` seconds."""

    def __init__(self, tokens: list[int], pace: float = 0.0, first_delay: float = 0.0) -> None:
        self.tokens, self.pace, self.first_delay = tokens, pace, first_delay

    def max_model_len(self) -> int:
        return 128

    def check_admission(self) -> None:
        """Never full."""

    async def admit(self, request):
        """Always room: the route is opaque to the Server."""
        return None

    async def generate(self, request, route=None):
        await asyncio.sleep(self.first_delay)
        n = min(len(self.tokens), request.params.max_tokens)
        for i, t in enumerate(self.tokens[:n]):
            await asyncio.sleep(self.pace)
            last = i == n - 1
            usage = common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=n) if last else None
            yield decode_pb2.GenerateEvent(token_ids=[t], finish_reason="length" if last else "", usage=usage)
