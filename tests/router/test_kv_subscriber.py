"""The router's KV index follows a node's KvEvents stream: snapshot, events, gap, drop, restart."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.engine.block_keys import namespace_root, prompt_block_keys
from pdserve.v1 import decode_pb2_grpc
from pdserve.router.kv_index import KvIndex
from pdserve.router.kv_subscriber import KvSubscriber
from tests.router.kv_fake_node import FakeKvNode, serve, until

ROOT = namespace_root("model=t;block_size=4")
A = list(range(100, 116))  # 4 full blocks of 4 tokens
B = list(range(200, 212))  # 3 blocks


@pytest.fixture
async def node_and_subscriber():
    node = FakeKvNode()
    server, address = await serve(node)
    channel = grpc.aio.insecure_channel(address)
    index = KvIndex()
    sub = KvSubscriber(address, decode_pb2_grpc.DecodeStub(channel), index, backoff=0.01, max_backoff=0.05)
    sub.start()
    yield node, sub, index
    await sub.stop()
    await channel.close()
    await server.stop(None)


def hits(index: KvIndex, sub: KvSubscriber, tokens: list[int]) -> int:
    return index.match(prompt_block_keys(ROOT, tokens, 4), [sub.address])[sub.address]


async def test_snapshot_then_events(node_and_subscriber):
    node, sub, index = node_and_subscriber
    await until(lambda: index.is_synced(sub.address))
    node.fill(A, ROOT)  # after the (empty) snapshot: arrives as a STORED event
    await until(lambda: hits(index, sub, A) == 4)
    assert hits(index, sub, B) == 0
    assert hits(index, sub, A[:8] + [1, 2, 3, 4]) == 2  # a shared leading run only


async def test_snapshot_is_chunked_and_complete(node_and_subscriber):
    node, sub, index = node_and_subscriber
    await until(lambda: index.is_synced(sub.address))
    await sub.stop()
    node.fill(A, ROOT)
    node.fill(B, ROOT)  # 7 keys: three chunks of SNAPSHOT_CHUNK=3
    sub.last_seq = 0
    sub.start()
    await until(lambda: hits(index, sub, A) == 4 and hits(index, sub, B) == 3)


async def test_gap_resyncs_from_a_snapshot(node_and_subscriber):
    node, sub, index = node_and_subscriber
    await until(lambda: index.is_synced(sub.address))
    node.gap = True
    node.fill(A, ROOT)  # this event is lost on the wire
    await asyncio.sleep(0.1)
    node.fill(B, ROOT)  # its seq reveals the gap
    await until(lambda: sub.resyncs["gap"] == 1)
    await until(lambda: hits(index, sub, A) == 4 and hits(index, sub, B) == 3)


async def test_dropped_stream_resumes_without_snapshot_and_is_cold_meanwhile(node_and_subscriber):
    node, sub, index = node_and_subscriber
    node.fill(A, ROOT)
    await until(lambda: hits(index, sub, A) == 4)
    sub.backoff = sub.max_backoff = 0.3  # a visible window while the stream is down
    node.break_streams()
    await until(lambda: sub.resyncs["dropped"] == 1)
    assert not index.is_synced(sub.address) and hits(index, sub, A) == 0  # never served while down
    assert index.node_size(sub.address) == 4  # kept for the resume
    node.fill(B, ROOT)  # missed while down: replayed on resume
    await until(lambda: hits(index, sub, B) == 3)
    assert hits(index, sub, A) == 4
    assert sub.resyncs["gap"] == 0 and sub.resyncs["restart"] == 0


async def test_evictions_remove_entries(node_and_subscriber):
    node, sub, index = node_and_subscriber
    node.fill(A, ROOT)
    await until(lambda: hits(index, sub, A) == 4)
    for i in range(30):  # 30 x 3 blocks through a 64-block pool: A's blocks get reused
        node.fill([1000 + i * 12 + j for j in range(12)], ROOT)
    await until(lambda: hits(index, sub, A) == 0)
    assert index.node_size(sub.address) <= node.num_blocks


async def test_restart_drops_the_old_incarnation(node_and_subscriber):
    node, sub, index = node_and_subscriber
    node.fill(A, ROOT)
    await until(lambda: hits(index, sub, A) == 4)
    old_id = sub.node_id
    node.restart()  # new node_id, empty cache
    node.break_streams()
    node.fill(B, ROOT)
    await until(lambda: sub.node_id != old_id and hits(index, sub, B) == 3)
    assert hits(index, sub, A) == 0
    assert sub.resyncs["restart"] == 1


async def test_reset_drops_entries_at_once_then_resyncs(node_and_subscriber):
    node, sub, index = node_and_subscriber
    node.fill(A, ROOT)
    await until(lambda: hits(index, sub, A) == 4)
    sub.reset("unusable")
    assert hits(index, sub, A) == 0 and index.node_size(sub.address) == 0
    await until(lambda: hits(index, sub, A) == 4)


async def test_unimplemented_node_is_cold_and_quiet(caplog):
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(decode_pb2_grpc.DecodeServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    index = KvIndex()
    sub = KvSubscriber("n", decode_pb2_grpc.DecodeStub(channel), index, unsupported_retry=0.01)
    sub.start()
    try:
        await until(lambda: sub.unsupported)
        await asyncio.sleep(0.1)  # several retries
        assert not index.is_synced("n")
        assert sum("serves no KV events" in r.message for r in caplog.records) <= 1
    finally:
        await sub.stop()
        await channel.close()
        await server.stop(None)
