"""CacheStore with one-plane pools (DeepSeek's MLA: one latent per token, [L, N, 1, 1, B, D]): blocks
move whole and bit-exact between any two TP degrees (every rank holds the one latent "head" whole),
and the handshake refuses a peer whose plane count or latent width differs, naming both geometries,
with nothing written and no session left behind."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, SessionCredentials
from pdserve.cachestore.heads import HeadLayout, assigned_heads
from pdserve.node_runtime.rank_kv import pool_geometry
from tests.cachestore.helpers import SECRET

LAYERS, BLOCKS, BLOCK_SIZE, LATENT = 3, 10, 4, 48
LATENT_BYTES = BLOCK_SIZE * LATENT * 4  # one block's latent rows, fp32


def _latent_layout(rank: int = 0, size: int = 1, width: int = LATENT) -> HeadLayout:
    return HeadLayout.of_rank(1, BLOCK_SIZE * width * 4, rank, size, planes=1)


def _server(pool: torch.Tensor, layout: HeadLayout, transport: str) -> CacheStoreServer:
    geometry = PoolGeometry(LAYERS, BLOCKS, layout.block_bytes, layout)
    return CacheStoreServer(MemoryRegion.from_tensor(pool), geometry, transport=transport, secret=SECRET)


def _client(pool: torch.Tensor, layout: HeadLayout, transport: str) -> CacheStoreClient:
    geometry = PoolGeometry(LAYERS, BLOCKS, layout.block_bytes, layout)
    return CacheStoreClient(MemoryRegion.from_tensor(pool), geometry, transport=transport, secret=SECRET)


def _recv_bytes(server: CacheStoreServer) -> float:
    labels = {"model_name": "unknown", "transport": server.active_transport, "side": "recv"}
    return server.metrics.registry.get_sample_value("pdserve_cachestore_bytes_total", labels) or 0.0


def test_a_latent_block_is_one_span_of_one_plane():
    layout = _latent_layout(1, 2)
    assert (layout.first, layout.count, layout.planes) == (0, 1, 1)  # rank 1 of 2 holds the latent too
    assert layout.block_bytes == layout.slice_bytes(0, 1) == LATENT_BYTES
    assert layout.spans(1000, 0, 1) == ((1000, LATENT_BYTES),)
    with pytest.raises(ValueError, match="1 or 2 planes"):
        HeadLayout.of_rank(1, 16, planes=3)


def test_credentials_carry_the_planes_and_two_plane_ones_stay_as_they_were():
    base = dict(request_id="r", endpoint="h:1", transport="tcp", session_id="00", token="00", num_layers=1)
    latent = SessionCredentials(
        **base, block_bytes=LATENT_BYTES, block_ids=(1,), total_heads=1, head_bytes=LATENT_BYTES, planes=1
    )
    back = SessionCredentials.from_bytes(latent.to_bytes())
    assert back == latent and back.heads() == _latent_layout()
    pair = SessionCredentials(
        **base, block_bytes=2 * LATENT_BYTES, block_ids=(1,), total_heads=1, head_bytes=LATENT_BYTES
    )
    assert b"planes" not in pair.to_bytes() and SessionCredentials.from_bytes(pair.to_bytes()).planes == 2


def test_every_rank_of_any_tp_degree_gets_the_whole_latent():
    for a, b in [(1, 2), (2, 1), (1, 4), (4, 2), (2, 2)]:
        for q in range(b):
            receiver = _latent_layout(q, b)
            writers = [p for p in range(a) if assigned_heads(_latent_layout(p, a), receiver) is not None]
            assert writers == [0], (a, b, q)  # exactly one sender writes each block, whole
            assert assigned_heads(_latent_layout(0, a), receiver) == (0, 1)


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize("a,b", [(1, 2), (2, 1), (1, 1)])
async def test_latent_blocks_move_bit_exact_between_tp_degrees(transport, a, b):
    """P(TP=a) -> D(TP=b): each receiving rank gets exactly the listed blocks of every layer, whole,
    from one sending rank; nothing else of its pool changes, and it counts exactly those bytes."""
    src = torch.randn(LAYERS, BLOCKS, 1, 1, BLOCK_SIZE, LATENT)
    src_blocks, dst_blocks = [1, 2, 3, 7], [9, 0, 4, 5]
    dst_pools = [torch.zeros(LAYERS, BLOCKS, 1, 1, BLOCK_SIZE, LATENT) for _ in range(b)]
    servers = [_server(pool, _latent_layout(q, b), transport) for q, pool in enumerate(dst_pools)]
    clients = [_client(src.clone(), _latent_layout(p, a), transport) for p in range(a)]  # replicated latent
    for server in servers:
        await server.start()
    try:
        creds = [SessionCredentials.from_bytes(s.open_session("r", dst_blocks, timeout=10).to_bytes()) for s in servers]
        transfers = [client.open_transfer(c) for client in clients for c in creds if client.writes_to(c)]
        assert len(transfers) == b and all(tx.heads is None for tx in transfers)  # whole blocks, never sliced
        for tx in transfers:
            for layer in range(LAYERS):
                tx.write_layer(layer, src_blocks)
        await asyncio.gather(*(tx.finish(10) for tx in transfers))
        for server, pool in zip(servers, dst_pools):
            await server.get_session("r").wait_complete(5)
            assert torch.equal(pool[:, dst_blocks], src[:, src_blocks])
            assert not pool[:, [x for x in range(BLOCKS) if x not in dst_blocks]].any()
            assert _recv_bytes(server) == LAYERS * len(dst_blocks) * LATENT_BYTES
    finally:
        for client in clients:
            await client.close()
        for server in servers:
            server.close_session("r")
            await server.stop()


MISMATCHES = [
    # K/V pairs of the same bytes per head (another model): the planes differ
    (HeadLayout.of_rank(1, LATENT_BYTES), "the sender's blocks have 2 plane"),
    # a latent of another width (another MLA model, or a dtype): one head's bytes differ
    (_latent_layout(width=LATENT + 16), "the latent width"),
]


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize("sender,message", MISMATCHES)
async def test_the_handshake_refuses_another_plane_count_or_latent_width(transport, sender, message):
    receiver = _latent_layout()
    pool = torch.zeros(LAYERS, BLOCKS, 1, 1, BLOCK_SIZE, LATENT)
    server = _server(pool, receiver, transport)
    await server.start()
    src = torch.ones(LAYERS * BLOCKS * sender.block_bytes // 4)
    client = _client(src, sender, transport)
    try:
        creds = SessionCredentials.from_bytes(server.open_session("r", [0, 1], timeout=5).to_bytes())
        with pytest.raises(ValueError, match=message) as refused:
            client.open_transfer(creds)
        text = str(refused.value)
        assert sender.geometry() in text and receiver.geometry() in text  # both sides named
        with pytest.raises(ValueError, match="incompatible KV geometry"):
            client.writes_to(creds)
        assert not pool.any() and not server.get_session("r").landed
    finally:
        await client.close()
        server.close_session("r")
        await server.stop()
    assert server.num_sessions == 0


async def test_a_kv_pair_receiver_refuses_a_latent_sender():
    """The other direction: an MLA prefill node offered a K/V decode node's session."""
    receiver = HeadLayout.of_rank(1, LATENT_BYTES)
    pool = torch.zeros(LAYERS, BLOCKS, 2, 1, BLOCK_SIZE, LATENT)
    server = _server(pool, receiver, "local")
    await server.start()
    client = _client(torch.ones(LAYERS, BLOCKS, 1, 1, BLOCK_SIZE, LATENT), _latent_layout(), "local")
    try:
        creds = server.open_session("r", [3], timeout=5)
        with pytest.raises(ValueError, match=r"1 plane\(s\), the receiver's 2"):
            client.open_transfer(creds)
        assert not pool.any()
    finally:
        await client.close()
        server.close_session("r")
        await server.stop()


def test_a_latent_runner_states_one_plane_on_every_rank():
    """node_runtime's geometry of an MLA runner's pool: one plane, the one KV head on each TP rank."""
    for rank in range(2):
        tensor = torch.zeros(LAYERS, BLOCKS, 1, 1, BLOCK_SIZE, LATENT)
        pool = SimpleNamespace(
            tensor=tensor,
            num_layers=LAYERS,
            num_blocks=BLOCKS,
            block_size=BLOCK_SIZE,
            head_dim=LATENT,
            block_bytes=LATENT_BYTES,
        )
        runner = SimpleNamespace(
            kv_pool=pool, tp=SimpleNamespace(rank=rank, size=2), model_config=SimpleNamespace(num_key_value_heads=1)
        )
        geometry = pool_geometry(runner)
        assert geometry.heads == _latent_layout(rank, 2) and geometry.block_bytes == LATENT_BYTES
