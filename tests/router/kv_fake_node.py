"""A node that serves only KvEvents, from a real engine KvEventLog: the contract the router relies on.

It documents what a node's KvEvents servicer must do (proto/pdserve/v1/common.proto):
- a subscriber with after_seq = 0, an unknown node_id, or a sequence number the log no longer
  buffers gets a snapshot, chunked, the last chunk with snapshot_done and the snapshot's seq;
- a subscriber that resumes (its node_id, a buffered after_seq) gets at once one batch with the
  events it missed (possibly none) and seq = the log's head, so it knows the resume was accepted;
- then every event, in order, seq = previous + 1; if the subscriber falls behind the buffer, a
  new snapshot.
Test knobs: `gap` drops one event from the stream, `break_streams` aborts the open streams,
`restart` starts a new incarnation (new node_id, empty log).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_events import KvEvent, KvEventLog
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

SNAPSHOT_CHUNK = 3  # tiny, so tests cover chunked snapshots
COMPAT = "model=fake;block_size=4"


def to_proto(e: KvEvent) -> common_pb2.KvEvent:
    return common_pb2.KvEvent(kind=int(e.kind), seq=e.seq, keys=list(e.keys), parent_key=e.parent_key, medium="cpu")


class FakeKvNode(decode_pb2_grpc.DecodeServicer):
    """KvEvents over a BlockManager's event log; every other RPC is UNIMPLEMENTED (the base class)."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.gap = False
        self.salts: list[str | None] = []  # cache_salt of each Generate request
        self.prefill_hints: list[tuple[list[str], list[int]]] = []  # (prefill_addresses, prefill_cached_tokens)
        self.generation = 0  # break_streams bumps it: streams of an older generation abort
        self.restart()

    def restart(self) -> None:
        self.node_id = uuid.uuid4().hex
        self.log = KvEventLog(capacity=16)
        self.blocks = BlockManager(self.num_blocks, self.block_size, events=self.log)

    async def GetLoad(self, request, context):
        return common_pb2.LoadReport(
            role="decode",
            node_id=self.node_id,
            num_free_blocks=self.blocks.num_free_blocks,
            num_total_blocks=self.num_blocks,
            compatibility=COMPAT,
            block_size=self.block_size,
            max_model_len=4096,
        )

    async def Generate(self, request, context):
        """One token; usage says the whole prompt but its last token was cached (as a warm node would)."""
        self.salts.append(request.cache_salt if request.HasField("cache_salt") else None)
        self.prefill_hints.append((list(request.prefill_addresses), list(request.prefill_cached_tokens)))
        cached = len(request.prompt_token_ids) - 1
        usage = common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=1, cached_tokens=cached)
        yield decode_pb2.GenerateEvent(token_ids=[5], finish_reason="length", usage=usage)

    def fill(self, tokens: list[int], root: int) -> list[int]:
        """Prefill `tokens` (allocate + cache) and free them: they stay cached, as after a request."""
        ids, _ = self.blocks.allocate(tokens, root=root)
        self.blocks.cache_full_blocks(tokens, ids, len(tokens), root=root)
        self.blocks.free_blocks(ids)
        return ids

    def break_streams(self) -> None:
        """Abort every open stream with UNAVAILABLE (as when a connection drops)."""
        self.generation += 1

    def _snapshot(self) -> tuple[list[common_pb2.KvEventBatch], int]:
        snap = self.log.snapshot()
        keys = sorted(snap.keys)
        chunks = [keys[i : i + SNAPSHOT_CHUNK] for i in range(0, len(keys), SNAPSHOT_CHUNK)] or [[]]
        batches = [
            common_pb2.KvEventBatch(
                node_id=self.node_id, snapshot=True, snapshot_keys=c, snapshot_done=i == len(chunks) - 1, seq=snap.seq
            )
            for i, c in enumerate(chunks)
        ]
        return batches, snap.seq

    async def KvEvents(self, request, context):
        log, node_id, generation = self.log, self.node_id, self.generation
        missed = log.since(request.after_seq) if request.node_id == node_id and request.after_seq else None
        if missed is None:
            batches, seq = self._snapshot()
            for b in batches:
                yield b
        else:
            seq = missed[-1].seq if missed else request.after_seq
            yield common_pb2.KvEventBatch(node_id=node_id, seq=seq, events=[to_proto(e) for e in missed])
        while log is self.log:  # a restart ends the old incarnation's streams
            if generation != self.generation:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped")
            events = await asyncio.to_thread(log.wait, seq, 0.05)
            if events is None:  # fell behind the buffer: start over with a snapshot
                batches, seq = self._snapshot()
                for b in batches:
                    yield b
                continue
            if not events:
                continue
            seq = events[-1].seq
            if self.gap:
                self.gap = False
                events = events[1:]
            yield common_pb2.KvEventBatch(node_id=node_id, events=[to_proto(e) for e in events])


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    """A prefill node that reports load but serves no KV events (UNIMPLEMENTED: the router sees it cold).
    `queued` is the prompt tokens it reports pending."""

    def __init__(self, queued: int = 0) -> None:
        self.queued = queued

    async def GetLoad(self, request, context):
        return common_pb2.LoadReport(
            role="prefill", node_id="p", compatibility=COMPAT, block_size=4, num_queued_prefill_tokens=self.queued
        )


async def serve(node: FakeKvNode | FakePrefill) -> tuple[grpc.aio.Server, str]:
    """Serve `node` (and gRPC health, SERVING) on a free port of 127.0.0.1."""
    server = grpc.aio.server()
    if isinstance(node, FakePrefill):
        prefill_pb2_grpc.add_PrefillServicer_to_server(node, server)
    else:
        decode_pb2_grpc.add_DecodeServicer_to_server(node, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def until(cond, timeout: float = 5.0) -> None:
    """Wait (polling) until cond() is true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
