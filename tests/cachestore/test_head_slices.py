"""KV geometry per tensor-parallel rank: P with TP=a writes into D with TP=b, each sending rank the head
slices each receiving rank owns, bit-exact, each receiver getting exactly its share of the bytes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, SessionCredentials
from pdserve.cachestore import gpudirect, rdma, rdma_memory
from pdserve.cachestore.heads import HeadLayout, assigned_heads
from tests.cachestore.helpers import SECRET
from tests.cachestore.test_gpudirect_flush import Runtime

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM = 3, 12, 4, 8
HEAD_BYTES = BLOCK_SIZE * HEAD_DIM * 4  # fp32


def _rank_pool(full: torch.Tensor, heads: HeadLayout) -> torch.Tensor:
    """One rank's pool: [L, N, 2, its heads, block_size, head_dim], a contiguous copy of its heads."""
    return full[:, :, :, heads.first : heads.stop].contiguous()


def _geometry(heads: HeadLayout) -> PoolGeometry:
    return PoolGeometry(LAYERS, BLOCKS, heads.block_bytes, heads)


async def _move(
    total_heads: int,
    a: int,
    b: int,
    transport: str,
    src_blocks,
    dst_blocks,
    done=None,
    region=MemoryRegion.from_tensor,
    device: str = "cpu",
):
    """Every sending rank writes its assigned heads of every layer into every receiving rank.
    `done`: the sending ranks that write at all (default: all). `region`: how each pool is
    presented (a host tensor, or one standing in for device memory). Returns (full, receiver
    pools, servers). `device`: where the pools are."""
    full = torch.randn(LAYERS, BLOCKS, 2, total_heads, BLOCK_SIZE, HEAD_DIM, device=device)
    senders = [HeadLayout.of_rank(total_heads, HEAD_BYTES, p, a) for p in range(a)]
    receivers = [HeadLayout.of_rank(total_heads, HEAD_BYTES, q, b) for q in range(b)]
    dst_pools = [torch.zeros(LAYERS, BLOCKS, 2, r.count, BLOCK_SIZE, HEAD_DIM, device=device) for r in receivers]
    servers = [
        CacheStoreServer(region(pool), _geometry(r), transport=transport, secret=SECRET)
        for pool, r in zip(dst_pools, receivers)
    ]
    src_pools = [_rank_pool(full, s) for s in senders]
    clients = [
        CacheStoreClient(region(pool), _geometry(s), transport=transport, secret=SECRET)
        for pool, s in zip(src_pools, senders)
    ]
    for server in servers:
        await server.start()
    try:
        creds = [SessionCredentials.from_bytes(s.open_session("r", dst_blocks, timeout=10).to_bytes()) for s in servers]
        transfers = []
        for p, client in enumerate(clients):
            if done is not None and p not in done:
                continue
            for c in creds:
                if client.writes_to(c):
                    tx = client.open_transfer(c)
                    for layer in range(LAYERS):
                        tx.write_layer(layer, src_blocks)
                    transfers.append(tx)
        await asyncio.gather(*(tx.finish(10) for tx in transfers))
        return full, dst_pools, servers, receivers
    finally:
        for client in clients:
            await client.close()


async def _close(servers) -> None:
    for server in servers:
        server.close_session("r")
        await server.stop()


def _recv_bytes(server: CacheStoreServer) -> float:
    return (
        server.metrics.registry.get_sample_value(
            "pdserve_cachestore_bytes_total",
            {"model_name": "unknown", "transport": server.active_transport, "side": "recv"},
        )
        or 0.0
    )


@pytest.mark.parametrize("transport", ["tcp", "local", "rdma"])
@pytest.mark.parametrize("heads,a,b", [(4, 1, 2), (4, 2, 1), (4, 1, 4), (4, 4, 2), (4, 2, 2), (2, 1, 4), (2, 4, 1)])
async def test_each_receiving_rank_gets_exactly_its_heads(heads, a, b, transport, monkeypatch):
    if transport == "rdma":  # the emulated verbs device (cachestore/verbs_emu): K/V slices as RDMA WRITEs
        monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    src_blocks, dst_blocks = [1, 2, 3, 7], [9, 10, 4, 0]
    full, dst_pools, servers, receivers = await _move(heads, a, b, transport, src_blocks, dst_blocks)
    try:
        for pool, server, r in zip(dst_pools, servers, receivers):
            session = server.get_session("r")
            await session.wait_complete(5)
            want = full[:, src_blocks][:, :, :, r.first : r.stop]
            assert torch.equal(pool[:, dst_blocks], want)
            untouched = [x for x in range(BLOCKS) if x not in dst_blocks]
            assert not pool[:, untouched].any()
            # the counter of KV bytes received per rank: exactly this rank's share, no more
            assert _recv_bytes(server) == LAYERS * len(dst_blocks) * r.block_bytes
    finally:
        await _close(servers)


def _device_like(tensor: torch.Tensor) -> MemoryRegion:
    return MemoryRegion(memoryview(bytearray(0)), tensor, is_device=True)


@pytest.mark.parametrize("mode", [rdma_memory.STAGING, rdma_memory.GPUDIRECT])
@pytest.mark.parametrize("heads,a,b", [(4, 1, 2), (4, 2, 1), (2, 1, 4), (4, 4, 2)])
async def test_device_pools_send_and_receive_head_slices_over_rdma(heads, a, b, mode, monkeypatch):
    """P TP=a -> D TP=b over rdma between pools in device memory (stood in for by host tensors that
    report themselves as device memory, on the emulated verbs device): staged, each block's K and V
    slices gathered into the lane's slot (several pieces a run) and WRITTEN from there, committed
    from the receiver's mirror; or GPUDirect, WRITTEN from and into the pools themselves, each
    NOTIFY flushed. Bit-exact either way."""
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    if mode == rdma_memory.GPUDIRECT:
        monkeypatch.setenv(rdma_memory.GPUDIRECT_ENV, "on")  # the emulator has no peer-memory client
        monkeypatch.setattr(gpudirect, "load_cudart", lambda: Runtime(ordering=0, options=gpudirect.FLUSH_OPTION_HOST))
    else:
        monkeypatch.setenv(rdma_memory.STAGING_ENV, "1")  # a slot of one block: a run goes in several pieces
    src_blocks, dst_blocks = [1, 2, 3, 7], [9, 10, 4, 0]
    full, dst_pools, servers, receivers = await _move(heads, a, b, "rdma", src_blocks, dst_blocks, region=_device_like)
    try:
        for pool, server, r in zip(dst_pools, servers, receivers):
            registration = server._rdma.res.registration
            assert registration.mode == mode and (registration.flush is not None) == (mode == rdma_memory.GPUDIRECT)
            await server.get_session("r").wait_complete(5)
            assert torch.equal(pool[:, dst_blocks], full[:, src_blocks][:, :, :, r.first : r.stop])
            assert not pool[:, [x for x in range(BLOCKS) if x not in dst_blocks]].any()
            if registration.flush is not None:
                assert registration.flush.flushes > 0
    finally:
        await _close(servers)


async def test_a_gathering_rank_is_complete_only_once_every_sender_wrote():
    """D(TP=1) gathers from P(TP=2): one sending rank's heads alone do not complete the session."""
    _, _, servers, _ = await _move(4, 2, 1, "tcp", [0, 1], [5, 6], done={0})
    try:
        session = servers[0].get_session("r")
        assert session.state.value == "open" and not session.landed
        with pytest.raises(asyncio.TimeoutError):
            await session.wait_complete(0.2)
    finally:
        await _close(servers)


def test_every_head_has_exactly_one_writer():
    for total, a, b in [(4, 1, 2), (4, 2, 1), (8, 4, 2), (2, 4, 4), (2, 4, 1), (1, 2, 4)]:
        for q in range(b):
            r = HeadLayout.of_rank(total, 16, q, b)
            covered = []
            for p in range(a):
                got = assigned_heads(HeadLayout.of_rank(total, 16, p, a), r)
                covered += list(range(*got)) if got else []
            assert sorted(covered) == list(range(r.first, r.stop)), (total, a, b, q)


async def test_the_handshake_refuses_what_cannot_map():
    recv = HeadLayout.of_rank(4, HEAD_BYTES, 1, 2)
    pool = torch.zeros(LAYERS, BLOCKS, 2, 2, BLOCK_SIZE, HEAD_DIM)
    server = CacheStoreServer(MemoryRegion.from_tensor(pool), _geometry(recv), transport="local", secret=SECRET)
    await server.start()
    try:
        creds = server.open_session("r", [0], timeout=5)
        assert (creds.tp_rank, creds.tp_size, creds.total_heads) == (1, 2, 4)
        cases = [
            (HeadLayout.of_rank(8, HEAD_BYTES, 0, 1), "8 KV heads"),  # another model
            (HeadLayout.of_rank(4, HEAD_BYTES * 2, 0, 1), "block size, head size or dtype"),
            (None, "states no KV heads"),  # a sender that cannot say which heads it holds
        ]
        for layout, message in cases:
            nbytes = layout.block_bytes if layout else 4 * 2 * HEAD_BYTES
            src = torch.zeros(LAYERS * BLOCKS * nbytes // 4)
            client = CacheStoreClient(
                MemoryRegion.from_tensor(src), PoolGeometry(LAYERS, BLOCKS, nbytes, layout), transport="local"
            )
            with pytest.raises(ValueError, match=message):
                client.open_transfer(creds)
        with pytest.raises(ValueError, match="no KV heads for rank 2 of 2"):
            SessionCredentials.from_bytes(creds.to_bytes().replace(b'"tp_rank":1', b'"tp_rank":2'))
    finally:
        server.close_session("r")
        await server.stop()


async def test_a_frame_naming_heads_the_rank_does_not_hold_is_refused_and_lands_nothing():
    from pdserve.cachestore import wire
    from tests.cachestore.helpers import raw_connect, read_ack

    recv = HeadLayout.of_rank(4, HEAD_BYTES, 1, 2)  # heads [2, 4)
    pool = torch.zeros(LAYERS, BLOCKS, 2, 2, BLOCK_SIZE, HEAD_DIM)
    server = CacheStoreServer(MemoryRegion.from_tensor(pool), _geometry(recv), transport="tcp", secret=SECRET)
    await server.start()
    try:
        creds = server.open_session("r", [3], timeout=5)
        sid, token = bytes.fromhex(creds.session_id), bytes.fromhex(creds.token)
        cases = [((0, 2), 2 * 2 * HEAD_BYTES, wire.BAD_HEADS), ((2, 3), 2 * 2 * HEAD_BYTES, wire.BAD_LENGTH)]
        for seq, ((lo, hi), length, status) in enumerate(cases, 1):
            header = wire.Header(wire.KIND_WRITEVH, 0, sid, token, 0, wire.pack_heads(lo, hi), 1, seq, length)
            sock = await asyncio.to_thread(raw_connect, creds.endpoint)
            try:
                await asyncio.to_thread(sock.sendall, header.pack() + wire.pack_ids([3]) + b"\x11" * length)
                ack = await asyncio.to_thread(read_ack, sock)
            finally:
                sock.close()
            assert ack is not None and (ack.status, ack.seq) == (status, seq)
        assert not pool.any() and not server.get_session("r").landed
    finally:
        server.close_session("r")
        await server.stop()
