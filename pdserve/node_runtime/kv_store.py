"""A node's CacheStore ends, built one way for both roles and both directions.

P->D: the decode node receives (`receiver`), the prefill node sends (`sender`). D->P pull: the
prefill node receives the prefix blocks the decode node holds, the decode node sends them. Every
end is over the node's one KV pool, with the node's transport, cluster secret (HMAC handshake),
mutual TLS when configured, and metrics registry; fencing is the same `Session` logic either way.
"""

from __future__ import annotations

import asyncio
import logging

from pdserve.cachestore import (
    CacheStoreClient,
    CacheStoreServer,
    FaultInjector,
    MemoryRegion,
    Session,
    Transport,
)
from pdserve.cachestore.metrics import CacheStoreMetrics
from pdserve.node_runtime.node import NodeRuntime
from pdserve.node_runtime.node_config import NodeConfig
from pdserve.node_runtime.rank_kv import pool_geometry

log = logging.getLogger("pdserve.kv_store")
FENCE_WAIT = 5.0
"""Seconds a cut-off writer normally needs to leave the blocks (a shut-down socket wakes it at once)."""


def receiver(
    rt: NodeRuntime, config: NodeConfig, metrics: CacheStoreMetrics | None = None, transport: str | None = None
) -> CacheStoreServer:
    """Sessions over this node's pool, and the listener that writes into them (start() binds it).
    `metrics`: the node's sender's, so both directions count in one set of series. `transport`:
    the node's own unless given (`pull_transport`)."""
    tls = config.node.tls()
    return CacheStoreServer(
        MemoryRegion.from_tensor(rt.engine.kv_pool.tensor),
        pool_geometry(rt.engine.runner),  # rank 0's KV heads; ranks 1.. have their own ends
        transport=transport or config.transfer.transport,
        host=config.node.host,
        port=config.transfer.cachestore_port,
        secret=config.node.cluster_secret,
        registry=rt.metrics.registry,
        tls=tls.cachestore_tls() if tls else None,
        model_name=rt.metrics.model_name,
        metrics=metrics,
    )


def pull_transport(rt: NodeRuntime, transport: str) -> str:
    """The transport a prefill node receives D->P pulls over: its own, `transport` as its sender
    resolved it (`auto` was rdma where a device exists; resolving it again here logged the TCP
    fallback twice), except rdma on a CUDA pool without GPUDirect. There an rdma receiver
    mirrors the whole pool in pinned host memory, and a prefill node would hold that mirror for the
    occasional pull on top of its decode peers' own (on one H200 host, two nodes at 0.25 of the card
    each pinned more than the host had). TCP stages each connection's frames through a bounded
    buffer instead; the decode node's sender follows the transport its credentials name."""
    region = MemoryRegion.from_tensor(rt.engine.kv_pool.tensor)
    if transport != Transport.RDMA or not region.is_device:
        return transport
    from pdserve.cachestore import rdma_memory
    from pdserve.cachestore.rdma_verbs import verbs

    mode, reason = rdma_memory.choose(verbs(), region)
    if mode != rdma_memory.STAGING:
        return transport
    log.info(
        "event=pull_receiver transport=tcp: an rdma receiver would mirror the whole CUDA pool in host memory (%s)",
        reason,
    )
    return "tcp"


async def start_receiver(server: CacheStoreServer, advertise_host: str | None) -> None:
    """Start the listener; credentials carry `advertise_host` instead of a wildcard bind address,
    which other hosts cannot reach."""
    await server.start()
    if advertise_host and server.active_transport != Transport.LOCAL:
        server.endpoint = f"{advertise_host}:{server.endpoint.rsplit(':', 1)[1]}"


def sender(
    rt: NodeRuntime, config: NodeConfig, metrics: CacheStoreMetrics | None = None, transport: str | None = None
) -> CacheStoreClient:
    """Connections from this node's pool to receivers (faults only when a chaos test sets them).
    `metrics`: the node's receiver's, so both directions count in one set of series. `transport`:
    the node's own unless given (its receiver's, already resolved: `auto` resolved twice logged its
    TCP fallback twice)."""
    tls = config.node.tls()
    return CacheStoreClient(
        MemoryRegion.from_tensor(rt.engine.kv_pool.tensor),
        pool_geometry(rt.engine.runner),  # rank 0's KV heads; ranks 1.. have their own ends
        transport=transport or config.transfer.transport,
        secret=config.node.cluster_secret,
        registry=rt.metrics.registry,
        model_name=rt.metrics.model_name,
        faults=FaultInjector.from_env(),
        tls=tls.cachestore_tls() if tls else None,
        metrics=metrics,
    )


async def wait_fenced(session: Session, rid: str) -> None:
    """Wait until no writer is inside a closed session's blocks. Closing cuts every in-flight
    writer off, so the wait is short. If it is not, the blocks stay held (never freed under a live
    writer) and we keep waiting: a leak until the writer's thread returns is the price, corruption
    of another request is not."""
    try:
        await session.wait_safe_to_reuse(timeout=FENCE_WAIT)
    except asyncio.TimeoutError:
        log.error("request_id=%s event=writer_still_inside after_s=%.1f: blocks held until it leaves", rid, FENCE_WAIT)
        await session.wait_safe_to_reuse()
