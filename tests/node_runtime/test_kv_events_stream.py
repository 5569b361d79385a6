"""The KvEvents stream: snapshot first, then events; resume, resync after a gap or a restart."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.engine.block_keys import namespace_root, prompt_block_keys
from pdserve.engine.kv_events import KvEventLog
from pdserve.node_runtime.auth import cluster_metadata
from pdserve.node_runtime.kv_events_service import kv_event_batches
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from tests.e2e.grpc_client import generate, greedy, load
from tests.e2e.inproc import SECRET, in_process_nodes

PROMPT = [5 + (i * 11) % 1500 for i in range(100)]


async def first_batches(log: KvEventLog, request: common_pb2.KvEventsRequest, n: int) -> list:
    stream = kv_event_batches(log, "node-1", "cpu", request, lambda: False)
    try:
        return [await stream.__anext__() for _ in range(n)]
    finally:
        await stream.aclose()


async def test_resume_within_the_buffer_and_snapshot_after_a_gap():
    log = KvEventLog(capacity=3)
    for i in range(5):
        log.stored([100 + i], 7)
    log.removed([100])
    # still buffered (events 4..6): resumed without a snapshot; the acceptance comes first, at once
    accepted, batch = await first_batches(log, common_pb2.KvEventsRequest(after_seq=3, node_id="node-1"), 2)
    assert (accepted.snapshot, list(accepted.events), accepted.seq, accepted.node_id) == (False, [], 3, "node-1")
    assert not batch.snapshot and [e.seq for e in batch.events] == [4, 5, 6]
    # an accepted resume with nothing missed is announced too, without waiting for an event
    (caught_up,) = await first_batches(log, common_pb2.KvEventsRequest(after_seq=6, node_id="node-1"), 1)
    assert (caught_up.snapshot, list(caught_up.events), caught_up.seq) == (False, [], 6)
    assert batch.events[-1].kind == common_pb2.KvEvent.REMOVED and list(batch.events[-1].keys) == [100]
    # behind the buffer (a gap), another incarnation, or first contact: a complete snapshot
    for request in (
        common_pb2.KvEventsRequest(after_seq=1, node_id="node-1"),
        common_pb2.KvEventsRequest(after_seq=5, node_id="node-0"),
        common_pb2.KvEventsRequest(),
    ):
        (snap,) = await first_batches(log, request, 1)
        assert snap.snapshot and snap.snapshot_done and snap.seq == 6 and snap.node_id == "node-1"
        assert sorted(snap.snapshot_keys) == [101, 102, 103, 104]
    # events that arrive later follow the snapshot, numbered on from it
    stream = kv_event_batches(log, "node-1", "cpu", common_pb2.KvEventsRequest(), lambda: False)
    assert (await stream.__anext__()).snapshot
    log.cleared()
    nxt = await asyncio.wait_for(stream.__anext__(), 10)
    assert [(e.seq, e.kind) for e in nxt.events] == [(7, common_pb2.KvEvent.CLEARED)]
    await stream.aclose()


async def test_large_snapshot_is_chunked(monkeypatch):
    from pdserve.node_runtime import kv_events_service

    monkeypatch.setattr(kv_events_service, "SNAPSHOT_CHUNK_KEYS", 4)
    log = KvEventLog()
    log.stored(list(range(1, 11)), 0)
    chunks = await first_batches(log, common_pb2.KvEventsRequest(), 3)
    assert [c.snapshot_done for c in chunks] == [False, False, True]
    assert sorted(k for c in chunks for k in c.snapshot_keys) == list(range(1, 11))


async def read_snapshot(call) -> tuple[common_pb2.KvEventBatch, set[int]]:
    keys: set[int] = set()
    while True:
        batch = await asyncio.wait_for(call.read(), 30)
        assert batch.snapshot
        keys.update(batch.snapshot_keys)
        if batch.snapshot_done:
            return batch, keys


async def test_node_stream_matches_router_keys_resumes_and_resyncs_after_restart(tiny_model_dir):
    meta = cluster_metadata(SECRET)
    async with in_process_nodes(tiny_model_dir, num_prefill=0) as nodes:
        address = nodes.decode_address
        await generate(address, SECRET, "a", PROMPT, greedy(2), [], cache_salt="t")
        report = await load(address, SECRET)
        async with grpc.aio.insecure_channel(address) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.KvEvents(common_pb2.KvEventsRequest(), metadata=cluster_metadata("wrong")).read()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call = stub.KvEvents(common_pb2.KvEventsRequest(), metadata=meta)
            snap, keys = await read_snapshot(call)
            assert snap.node_id == report.node_id
            # what a router computes from the node's LoadReport is exactly what the node stored
            router_keys = prompt_block_keys(namespace_root(report.compatibility, "t"), PROMPT, report.block_size)
            assert len(router_keys) == 6 and set(router_keys) <= keys
            await generate(address, SECRET, "b", [9] * 40, greedy(2), [])
            batch = await asyncio.wait_for(call.read(), 30)
            assert not batch.snapshot and batch.events[0].seq == snap.seq + 1
            assert batch.events[0].kind == common_pb2.KvEvent.STORED and batch.events[0].medium == "cpu"
            call.cancel()
            resumed = stub.KvEvents(common_pb2.KvEventsRequest(after_seq=snap.seq, node_id=snap.node_id), metadata=meta)
            accepted = await asyncio.wait_for(resumed.read(), 30)
            assert not accepted.snapshot and not accepted.events and accepted.seq == snap.seq
            again = await asyncio.wait_for(resumed.read(), 30)
            assert not again.snapshot and again.events[0].seq == snap.seq + 1
            # the node stops: the open stream ends instead of hanging
            await nodes.decode.stop()
            try:  # a hang would end in TimeoutError, failing the test
                while await asyncio.wait_for(resumed.read(), 30) is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as e:  # the server's grace period cut it
                assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
    async with in_process_nodes(tiny_model_dir, num_prefill=0) as restarted:
        async with grpc.aio.insecure_channel(restarted.decode_address) as ch:
            call = decode_pb2_grpc.DecodeStub(ch).KvEvents(
                common_pb2.KvEventsRequest(after_seq=snap.seq, node_id=snap.node_id), metadata=meta
            )
            fresh, keys = await read_snapshot(call)
            assert fresh.node_id != snap.node_id and keys == set() and fresh.seq == 0
            call.cancel()


async def test_subscribers_are_bounded(tiny_model_dir):
    from pdserve.node_runtime.kv_events_service import MAX_SUBSCRIBERS

    meta = cluster_metadata(SECRET)
    async with in_process_nodes(tiny_model_dir, num_prefill=1) as nodes:
        async with grpc.aio.insecure_channel(nodes.prefill_addresses[0]) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            calls = [stub.KvEvents(common_pb2.KvEventsRequest(), metadata=meta) for _ in range(MAX_SUBSCRIBERS)]
            for call in calls:
                assert (await asyncio.wait_for(call.read(), 30)).snapshot_done
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(stub.KvEvents(common_pb2.KvEventsRequest(), metadata=meta).read(), 30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            calls.pop().cancel()
            for _ in range(100):  # the cancelled stream leaves within a wait
                if nodes.prefills[0]._kv_subscribers < MAX_SUBSCRIBERS:
                    break
                await asyncio.sleep(0.05)
            extra = stub.KvEvents(common_pb2.KvEventsRequest(), metadata=meta)
            assert (await asyncio.wait_for(extra.read(), 30)).snapshot
            for call in [*calls, extra]:
                call.cancel()
