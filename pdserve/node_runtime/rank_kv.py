"""The CacheStore endpoint of each tensor-parallel rank other than 0 (a side service of its process,
`engine.parallel.rank_commands`): on a decode node a receiver of the rank's KV heads, on a prefill
node a sender of them. Rank 0 drives them with commands (`node_runtime.rank_kv_driver`).

Every rank's pool holds only its KV heads (`pool_geometry` states which), so KV between nodes of
different TP degrees moves rank to rank, each sending rank writing the head slices each receiving
rank owns (`cachestore.heads`), with no gather on either side.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

from pdserve.cachestore import (
    CacheStoreClient,
    CacheStoreServer,
    FaultInjector,
    MemoryRegion,
    PoolGeometry,
    SessionCredentials,
    Transfer,
    Transport,
)
from pdserve.cachestore.heads import HeadLayout
from pdserve.engine.block_manager import blocks_for
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_connector import KvConnector


def pool_geometry(runner: Any) -> PoolGeometry:
    """The CacheStore geometry of a runner's KV pool, with the KV heads this rank holds. An MLA pool
    has one plane and one KV head (the latent), which every rank holds whole (replicated), so the
    head-sliced path never cuts it: each decode rank gets whole blocks, whatever the two TP degrees."""
    pool = runner.kv_pool
    rank, size = (runner.tp.rank, runner.tp.size) if runner.tp is not None else (0, 1)
    head_bytes = pool.block_size * pool.head_dim * pool.tensor.element_size()
    planes = pool.tensor.shape[2]  # [layers, blocks, planes, heads, block_size, head_dim]
    heads = HeadLayout.of_rank(runner.model_config.num_key_value_heads, head_bytes, rank, size, planes)
    return PoolGeometry(pool.num_layers, pool.num_blocks, pool.block_bytes, heads)


def ready_event(pool: Any) -> Any:
    """On a CUDA pool: an event recorded now on the pool's stream, after this layer's KV writes; the
    sender thread waits on it (never the engine thread). None on CPU, where the writes are done."""
    if not pool.is_cuda:
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(pool.device))
    return event


class LayerStreamer(KvConnector):
    """The prefill side's KV connector (worker half): after each layer has written its KV, hand that
    layer's blocks to the transfers of every request whose prompt completes in this step (earlier
    chunks' layers are final by then too), so sending layer i overlaps computing layer i+1. Rank 0
    of a prefill node and each of its other ranks (`SenderRank`) run one over their own pool."""

    def __init__(self, transfers_of: Callable[[str], tuple[list[Transfer], int] | None]) -> None:
        self.transfers_of = transfers_of
        """request id -> (its Transfers, one per decode rank this rank writes heads to; index of the
        first block they write: the decode node holds the ones before), or None. Set by the event
        loop before the request is admitted, read by the engine thread in `save_layer`."""
        self.pool: Any = None

    def register_kv_pool(self, pool: Any) -> None:
        self.pool = pool

    def save_layer(self, layer: int, batch: ForwardBatch) -> None:
        ready = None
        block_size = self.pool.block_size
        for rid, ctx, table, last in zip(batch.request_ids, batch.context_lens, batch.block_tables, batch.sample_mask):
            entry = self.transfers_of(rid)
            if entry is not None and last:
                if ready is None:
                    ready = ready_event(self.pool.tensor)
                txs, first = entry
                for tx in txs:
                    tx.write_layer(layer, table[first : blocks_for(ctx, block_size)], ready_event=ready)


class _RankEndpoint:
    """A command handler with its own event loop thread (CacheStore endpoints live on a loop)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.geometry = pool_geometry(runner)
        self.region = MemoryRegion.from_tensor(runner.kv_pool.tensor)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="rank-kv").start()

    def handle(self, msg: dict, reply: Callable[[dict], None]) -> None:
        op = getattr(self, f"op_{msg.get('op')}", None)
        if op is None:
            reply({"error": f"unknown command {msg.get('op')!r}"})
            return

        async def run() -> None:
            try:
                reply(await op(msg) or {})
            except Exception as e:  # answered, never the rank's death
                reply({"error": f"{type(e).__name__}: {e}"})

        asyncio.run_coroutine_threadsafe(run(), self.loop)

    @staticmethod
    def _tls(msg: dict):
        if not msg.get("tls"):
            return None
        from pdserve.node_runtime.cluster_tls import ClusterTLS

        loaded = ClusterTLS.from_files(*msg["tls"])
        return loaded.cachestore_tls() if loaded else None


class ReceiverRank(_RankEndpoint):
    """A decode node's rank: a CacheStore receiver on its pool; sessions opened and closed by rank 0."""

    server: CacheStoreServer

    async def op_start(self, msg: dict) -> dict:
        self.server = CacheStoreServer(
            self.region,
            self.geometry,
            transport=msg["transport"],
            host=msg["host"],
            secret=msg["secret"],
            tls=self._tls(msg),
        )
        await self.server.start()
        endpoint = self.server.endpoint
        if msg.get("advertise_host") and self.server.active_transport != Transport.LOCAL:
            endpoint = self.server.endpoint = f"{msg['advertise_host']}:{endpoint.rsplit(':', 1)[1]}"
        return {"endpoint": endpoint}

    async def op_stats(self, msg: dict) -> dict:
        return {"sessions": self.server.num_sessions, "recv_bytes": self.server.metrics.received_bytes()}

    async def op_open(self, msg: dict) -> dict:
        creds = self.server.open_session(msg["rid"], list(msg["blocks"]), timeout=float(msg["timeout"]))
        return {"creds": creds.to_bytes().decode()}

    async def op_wait(self, msg: dict) -> dict:
        session = self.server.get_session(msg["rid"])
        if session is None:
            raise KeyError(f"no KV session for {msg['rid']!r} on this rank")
        await session.wait_complete(float(msg["timeout"]))
        return {}

    async def op_close(self, msg: dict) -> dict:
        """Close the session and answer once no writer can touch its blocks (rank 0 frees them then)."""
        session = self.server.close_session(msg["rid"])
        if session is not None:
            await session.wait_safe_to_reuse()
        return {"recv_bytes": self.server.metrics.received_bytes()}


class SenderRank(_RankEndpoint):
    """A prefill node's rank: writes its KV heads of each request into the decode ranks that own them,
    from its `LayerStreamer` in every step it runs."""

    client: CacheStoreClient

    def __init__(self, runner: Any) -> None:
        super().__init__(runner)
        self.transfers: dict[str, tuple[list[Transfer], int]] = {}
        """This rank's transfers by request id (opened and ended by rank 0's commands)."""
        self.connector = LayerStreamer(self.transfers.get)
        """What the rank's every `run` calls after each layer (`engine.parallel.rank_commands`)."""
        self.connector.register_kv_pool(runner.kv_pool)

    async def op_start(self, msg: dict) -> dict:
        self.client = CacheStoreClient(
            self.region,
            self.geometry,
            transport=msg["transport"],
            secret=msg["secret"],
            tls=self._tls(msg),
            faults=FaultInjector.from_env(),
        )
        return {}

    async def op_stats(self, msg: dict) -> dict:
        return {"transfers": len(self.transfers)}

    async def op_open(self, msg: dict) -> dict:
        """Open a transfer into every decode rank this rank writes heads to (before the prompt runs)."""
        creds = [SessionCredentials.from_bytes(c.encode()) for c in msg["creds"]]
        txs = [self.client.open_transfer(c) for c in creds if self.client.writes_to(c)]
        self.transfers[msg["rid"]] = (txs, int(msg["held_blocks"]))
        return {"transfers": len(txs)}

    async def op_finish(self, msg: dict) -> dict:
        txs, _ = self.transfers.pop(msg["rid"], ([], 0))
        try:
            seconds = [await tx.finish(timeout=float(msg["timeout"])) for tx in txs]
        except Exception:
            for tx in txs:  # one failed: the others stop too (the request is aborted on both nodes)
                tx.abort("another rank's transfer failed")
            raise
        return {"transfer_seconds": max(seconds, default=0.0)}

    async def op_abort(self, msg: dict) -> dict:
        txs, _ = self.transfers.pop(msg["rid"], ([], 0))
        for tx in txs:
            tx.abort(msg.get("reason", "aborted"))
        return {}
