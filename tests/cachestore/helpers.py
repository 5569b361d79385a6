"""Shared helpers for CacheStore tests: pools, raw wire clients, a sender process."""

from __future__ import annotations

import asyncio
import os
import socket

from pdserve.cachestore import MemoryRegion, PoolGeometry, wire

SECRET = b"test-secret"
CANARY = 0xA5


def pools(geo: PoolGeometry, seed: int = 0) -> tuple[bytearray, bytearray]:
    """(random source pool, canary-filled destination pool)."""
    rng = __import__("random").Random(seed)
    src = bytearray(rng.randbytes(geo.total_bytes))
    dst = bytearray([CANARY]) * geo.total_bytes
    return src, dst


def block(buf: bytearray, geo: PoolGeometry, layer: int, b: int) -> bytes:
    start = geo.offset(layer, b)
    return bytes(buf[start : start + geo.block_bytes])


def untouched_outside(dst: bytearray, geo: PoolGeometry, allowed: set[tuple[int, int]]) -> bool:
    """Every byte of every (layer, block) not in `allowed` still holds the canary."""
    canary = bytes([CANARY]) * geo.block_bytes
    return all(
        block(dst, geo, layer, b) == canary
        for layer in range(geo.num_layers)
        for b in range(geo.num_blocks)
        if (layer, b) not in allowed
    )


def raw_connect(endpoint: str, secret: bytes = SECRET) -> socket.socket:
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    nonce = sock.recv(wire.NONCE_BYTES, socket.MSG_WAITALL)
    sock.sendall(wire.auth_tag(secret, nonce))
    return sock


def write_header(
    creds,
    layer: int,
    dst: int,
    count: int,
    payload_len: int | None = None,
    token: bytes | None = None,
    session_id: bytes | None = None,
) -> bytes:
    return wire.Header(
        wire.KIND_WRITE,
        0,
        session_id or bytes.fromhex(creds.session_id),
        token or bytes.fromhex(creds.token),
        layer,
        dst,
        count,
        1,
        count * creds.block_bytes if payload_len is None else payload_len,
    ).pack()


def read_ack(sock: socket.socket) -> wire.Header | None:
    data = sock.recv(wire.HEADER_BYTES, socket.MSG_WAITALL)
    return wire.unpack(data) if len(data) == wire.HEADER_BYTES else None


def sender_process(
    creds_bytes: bytes,
    geo_args: tuple[int, int, int],
    src_blocks: list[int],
    layers: list[int],
    seed: int,
    die_after_bytes: int | None = None,
) -> None:
    """Child process: send `layers` of src_blocks with the real client (or die mid-payload)."""
    import asyncio

    from pdserve.cachestore import CacheStoreClient, SessionCredentials

    geo = PoolGeometry(*geo_args)
    src, _ = pools(geo, seed)
    creds = SessionCredentials.from_bytes(creds_bytes)
    if die_after_bytes is not None:  # a sender that crashes halfway through a payload
        sock = raw_connect(creds.endpoint)
        sock.sendall(write_header(creds, layers[0], creds.block_ids[0], 1))
        sock.sendall(bytes(src[:die_after_bytes]))
        os._exit(1)

    async def run() -> None:
        client = CacheStoreClient(MemoryRegion.from_buffer(src), geo, transport="tcp", secret=SECRET)
        tx = client.open_transfer(creds)
        for layer in layers:
            tx.write_layer(layer, src_blocks)
        await tx.finish(20)
        await client.close()

    asyncio.run(run())


def rejected(srv, reason: str, transport: str = "tcp") -> float:
    """How many frames `srv` refused for `reason` (its pdserve_cachestore_rejected_frames counter)."""
    labels = {"model_name": srv.metrics.model_name, "transport": transport, "reason": reason}
    return srv.metrics.registry.get_sample_value("pdserve_cachestore_rejected_frames_total", labels) or 0.0


async def until(predicate, within: float = 30.0) -> bool:
    """Poll `predicate` with a deadline generous enough for a loaded 2-core machine."""
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
