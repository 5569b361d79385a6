"""Rank 0's side of the per-rank CacheStore endpoints (`node_runtime.rank_kv`): start them, and open,
wait for, close (receivers) or open, finish, abort (senders) one request's KV on every other rank.

With TP=1 there are no other ranks and every call is a no-op, so the nodes call these unconditionally.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, Counter

RECEIVER = "pdserve.node_runtime.rank_kv:ReceiverRank"
SENDER = "pdserve.node_runtime.rank_kv:SenderRank"


def endpoint_options(config: Any, transport: str) -> dict:
    """What every rank's endpoint is started with: the node's transport, bind host, secret and TLS files."""
    node = config.node
    tls = [node.cluster_tls_cert, node.cluster_tls_key, node.cluster_tls_ca] if node.cluster_tls_cert else None
    return {
        "transport": transport,
        "host": node.host,
        "advertise_host": node.advertise_host,
        "secret": node.cluster_secret,
        "tls": tls,
    }


def with_rank_service(config: Any, service: str) -> Any:
    """`config` whose engine runs `service` on every rank other than 0 (only with TP > 1)."""
    from dataclasses import replace

    if config.engine.tensor_parallel_size == 1:
        return config
    return replace(config, engine=replace(config.engine, rank_service=service))


class RankKVError(RuntimeError):
    """A rank's CacheStore endpoint refused or failed a command (its message says why)."""


class RankEndpoints:
    """The other ranks of this node's engine, as CacheStore endpoints."""

    def __init__(self, runner: Any, registry: CollectorRegistry | None = None, model_name: str = "unknown") -> None:
        ranks = getattr(runner, "ranks", None)
        self.commands = ranks.commands if ranks is not None else None
        self.ranks: list[int] = self.commands.ranks if self.commands is not None else []
        self.received = Counter(
            "pdserve_cachestore_rank_received_bytes",
            "KV bytes received into each tensor-parallel rank's pool (its heads' share)",
            ["model_name", "rank"],
            registry=registry if registry is not None else CollectorRegistry(),  # never the global one
        )
        self.model_name = model_name
        self._seen: dict[int, float] = {}

    async def _call(self, rank: int, msg: dict) -> dict:
        assert self.commands is not None, "only a tensor-parallel engine has other ranks"
        reply = await asyncio.wrap_future(self.commands.call(rank, msg))
        if "error" in reply:
            raise RankKVError(f"tensor-parallel rank {rank}: {reply['error']}")
        return reply

    async def _all(self, msg: dict) -> list[dict]:
        return list(await asyncio.gather(*(self._call(r, msg) for r in self.ranks)))

    def record_received(self, rank: int, total: float) -> None:
        """Advance rank `rank`'s received-bytes counter to the endpoint's running total."""
        delta = total - self._seen.get(rank, 0.0)
        if delta > 0:
            self._seen[rank] = total
            self.received.labels(self.model_name, str(rank)).inc(delta)

    async def stats(self) -> list[dict]:
        """Every other rank's open sessions (receivers) or transfers (senders): a test's leak check."""
        return await self._all({"op": "stats"})

    # receivers (decode node) ---------------------------------------------------------------------
    async def start_receivers(self, **options: Any) -> list[str]:
        """Start every rank's receiver; their endpoints in rank order."""
        return [r["endpoint"] for r in await self._all({"op": "start", **options})]

    async def open_sessions(self, rid: str, blocks: list[int], timeout: float) -> list[bytes]:
        """Every other rank's credentials for `blocks` of request `rid`, in rank order."""
        replies = await self._all({"op": "open", "rid": rid, "blocks": blocks, "timeout": timeout})
        return [r["creds"].encode() for r in replies]

    async def wait_complete(self, rid: str, timeout: float) -> None:
        await self._all({"op": "wait", "rid": rid, "timeout": timeout})

    async def close_sessions(self, rid: str) -> None:
        """Close `rid`'s session on every other rank; returns once no writer can touch its blocks."""
        for rank, reply in zip(self.ranks, await self._all({"op": "close", "rid": rid})):
            self.record_received(rank, float(reply.get("recv_bytes", 0.0)))

    # senders (prefill node) ----------------------------------------------------------------------
    async def start_senders(self, **options: Any) -> None:
        await self._all({"op": "start", **options})

    async def open_transfers(self, rid: str, creds: list[bytes], held_blocks: int) -> None:
        """Every other rank opens its transfers into the decode ranks it writes heads to."""
        await self._all({"op": "open", "rid": rid, "creds": [c.decode() for c in creds], "held_blocks": held_blocks})

    async def finish(self, rid: str, timeout: float) -> float:
        """Every other rank's transfers acknowledged: the slowest rank's transfer seconds."""
        replies = await self._all({"op": "finish", "rid": rid, "timeout": timeout})
        return max((float(r["transfer_seconds"]) for r in replies), default=0.0)

    async def abort(self, rid: str) -> None:
        await asyncio.gather(*(self._call(r, {"op": "abort", "rid": rid}) for r in self.ranks), return_exceptions=True)
