"""Prefill and decode nodes inside the test process (KV over the in-process `local` transport):
no process start-up, and the engines can be inspected directly between requests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pdserve.engine.config import EngineConfig
from pdserve.node_runtime.node_config import NodeConfig, NodeOptions, TransferOptions

SECRET = "s"


@dataclass
class Nodes:
    prefills: list  # PrefillNode
    decode: object  # DecodeNode
    prefill_addresses: list[str]
    decode_address: str

    def all(self) -> list:
        return [*self.prefills, self.decode]


async def assert_no_blocks_used(nodes: Nodes, decode: bool = True) -> None:
    """Every node's blocks are free and owned as its requests say (no leak, no double free).
    `decode` False: the prefill nodes only (a test killed the decode node, and its pool with it)."""
    for node in nodes.all() if decode else nodes.prefills:
        engine = node.rt.engine
        if node.rt.stopped:  # a node a test stopped: its engine thread is gone, its state stays readable
            engine.check_integrity()
        else:
            await node.rt.loop_thread.call(engine.check_integrity)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, node.rt.role
        assert not engine.requests, (node.rt.role, list(engine.requests))
        assert not node.rt.requests, (node.rt.role, [r.request_id for r in node.rt.requests])
    assert not decode or nodes.decode.cachestore.num_sessions == 0
    for p in nodes.prefills:  # D->P pulls: every session settled, no block held by a pull
        assert p.pulls.cachestore.num_sessions == 0 and not p.pulls.connector.owned_blocks()


@contextlib.asynccontextmanager
async def in_process_nodes(
    model_dir,
    num_prefill: int = 1,
    *,
    reuse: bool = True,
    local_max: int = 0,
    num_kv_blocks: int = 256,
    pull_min: int = 0,
    transport: str = "local",
    kv_timeout: float = 60.0,
) -> AsyncIterator[Nodes]:
    """Start `num_prefill` prefill nodes and one decode node (stopped however the block ends).
    `pull_min`: the decode node's --kv-pull-min-blocks (0 here: D->P pulls off, as before them)."""
    from pdserve.decode_node import DecodeNode
    from pdserve.prefill_node import PrefillNode

    transfer = TransferOptions(transport=transport, kv_timeout=kv_timeout)
    node = NodeOptions(
        cluster_secret=SECRET, kv_reuse=reuse, local_prefill_max_tokens=local_max, kv_pull_min_blocks=pull_min
    )
    prefills = [
        PrefillNode(NodeConfig(EngineConfig(model_dir, num_kv_blocks=num_kv_blocks), node, transfer))
        for _ in range(num_prefill)
    ]
    decode = DecodeNode(
        NodeConfig(EngineConfig(model_dir, num_kv_blocks=num_kv_blocks, preemption="never"), node, transfer)
    )
    started: list = []
    try:
        addresses = []
        for p in prefills:
            addresses.append(await p.start())
            started.append(p)
        decode_address = await decode.start()
        started.append(decode)
        yield Nodes(prefills, decode, addresses, decode_address)
    finally:
        for n in reversed(started):
            if not n.rt.stopped:  # a test may have stopped it (a node death)
                await n.stop()
