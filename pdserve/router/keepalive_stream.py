"""SSE keep-alive: a comment line while a stream has nothing to send.

Load balancers and proxies cut connections idle for a while (often 60 s); a long prompt's prefill,
or a retry after a node failure, can keep a stream silent that long before its first token. An SSE
comment (a line starting with ':') keeps bytes moving, and every SSE client ignores it."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, TypeVar

KEEPALIVE_COMMENT = ": keep-alive\n\n"
DEFAULT_INTERVAL = 15.0
"""Seconds of silence before a keep-alive comment (well under the common 60 s idle cut-off)."""

T = TypeVar("T")


class KeepAlive:
    """Marks a gap in `with_keepalive`'s output: the caller writes KEEPALIVE_COMMENT for it."""


async def with_keepalive(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | type[KeepAlive]]:
    """The items of `source`, plus `KeepAlive` after every `interval` seconds without one.

    The pending `anext` is waited on in slices, never cancelled and re-issued: cancelling an async
    generator's step would close it."""
    if interval <= 0:
        raise ValueError(f"the keep-alive interval must be > 0, got {interval}")
    it = source.__aiter__()
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(it.__anext__())
            while not (await asyncio.wait({step}, timeout=interval))[0]:
                yield KeepAlive
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        if step is not None and not step.done():
            step.cancel()
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
