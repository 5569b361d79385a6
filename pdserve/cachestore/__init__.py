"""CacheStore: layer-wise KV transfer between nodes (tcp | rdma | local transports).

It sees memory regions, a per-layer block geometry and block ids — never model code.

Receiver (decode side, inside an asyncio loop)::

    server = CacheStoreServer(MemoryRegion.from_tensor(pool), PoolGeometry(L, N, block_bytes),
                              transport="tcp", secret=b"...")
    await server.start()
    creds = server.open_session(request_id, block_ids, num_layers=L, timeout=30.0)
    session = server.get_session(request_id)
    await session.wait_complete()            # notification, no polling
    server.close_session(request_id)         # release by request id
    await session.wait_safe_to_reuse()       # no writer can still touch the blocks

Sender (prefill side)::

    client = CacheStoreClient(region, geometry, transport="tcp", secret=b"...")
    tx = client.open_transfer(SessionCredentials.from_bytes(creds_bytes))
    tx.write_layer(layer, src_block_ids)     # any thread; non-blocking; coalesces runs
    await tx.finish(timeout=30.0)            # all acknowledged, or TransferError

Mutual TLS on the TCP links: pass the same `tls=LinkTLS.from_files(cert, key, ca, name)` to both ends.
"""

from __future__ import annotations

from pdserve.cachestore.channel import Transfer, TransferError
from pdserve.cachestore.client import CacheStoreClient
from pdserve.cachestore.credentials import SessionCredentials
from pdserve.cachestore.faults import FaultInjector
from pdserve.cachestore.geometry import MemoryRegion, PoolGeometry, Run, coalesce
from pdserve.cachestore.server import CacheStoreServer
from pdserve.cachestore.session import Session, SessionError, SessionState
from pdserve.cachestore.tls import LinkTLS
from pdserve.cachestore.transport import Transport, resolve_transport

__all__ = [
    "CacheStoreClient",
    "CacheStoreServer",
    "FaultInjector",
    "LinkTLS",
    "MemoryRegion",
    "PoolGeometry",
    "Run",
    "Session",
    "SessionCredentials",
    "SessionError",
    "SessionState",
    "Transfer",
    "TransferError",
    "coalesce",
    "resolve_transport",
    "Transport",
]
