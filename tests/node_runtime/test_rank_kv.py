"""The per-rank CacheStore endpoints (node_runtime.rank_kv) driven by commands as rank 0 sends them,
and the command pipes themselves (engine.parallel.rank_commands), without loading a model."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.parallel.group import RankFailure
from pdserve.engine.parallel.rank_commands import RankCommands
from pdserve.node_runtime.rank_kv import ReceiverRank, SenderRank

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 8, 4, 2, 8


def _runner(rank: int, size: int, fill: bool) -> SimpleNamespace:
    """What a rank's endpoint reads of its ModelRunner: the pool, the TP rank and the model's KV heads."""
    local = HEADS // size
    shape = (LAYERS, BLOCKS, 2, local, BLOCK_SIZE, HEAD_DIM)
    tensor = torch.randn(shape) if fill else torch.zeros(shape)
    pool = SimpleNamespace(
        tensor=tensor,
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        head_dim=HEAD_DIM,
        block_bytes=2 * local * BLOCK_SIZE * HEAD_DIM * 4,
    )
    return SimpleNamespace(
        kv_pool=pool, tp=SimpleNamespace(rank=rank, size=size), model_config=SimpleNamespace(num_key_value_heads=HEADS)
    )


def _call(endpoint, msg: dict) -> dict:
    done, box = threading.Event(), {}

    def reply(answer: dict) -> None:
        box.update(answer)
        done.set()

    endpoint.handle(msg, reply)
    assert done.wait(10), msg
    return box


def _batch(rid: str, blocks: list[int]) -> ForwardBatch:
    n = len(blocks) * BLOCK_SIZE
    return ForwardBatch([rid], list(range(n)), [n], [n], [blocks], [True])


def test_a_sending_rank_fills_a_receiving_rank_and_an_abort_leaves_nothing():
    sender = SenderRank(_runner(0, 1, fill=True))  # P(TP=1): every head
    receiver = ReceiverRank(_runner(1, 2, fill=False))  # D(TP=2) rank 1: head 1 only
    start = {"transport": "tcp", "host": "127.0.0.1", "secret": "s"}
    assert _call(receiver, {"op": "start", **start})["endpoint"].startswith("127.0.0.1:")
    assert _call(sender, {"op": "start", **start}) == {}
    creds = _call(receiver, {"op": "open", "rid": "r", "blocks": [5, 6], "timeout": 10})["creds"]
    assert _call(sender, {"op": "open", "rid": "r", "creds": [creds], "held_blocks": 0}) == {"transfers": 1}
    for layer in range(LAYERS):
        sender.connector.save_layer(layer, _batch("r", [1, 2]))
    assert "error" not in _call(sender, {"op": "finish", "rid": "r", "timeout": 10})
    assert _call(receiver, {"op": "wait", "rid": "r", "timeout": 10}) == {}
    closed = _call(receiver, {"op": "close", "rid": "r"})
    src, dst = sender.runner.kv_pool.tensor, receiver.runner.kv_pool.tensor
    assert torch.equal(dst[:, [5, 6]], src[:, [1, 2], :, 1:2])
    assert closed["recv_bytes"] == LAYERS * 2 * 2 * BLOCK_SIZE * HEAD_DIM * 4  # exactly its head's share

    creds = _call(receiver, {"op": "open", "rid": "q", "blocks": [0], "timeout": 10})["creds"]
    _call(sender, {"op": "open", "rid": "q", "creds": [creds], "held_blocks": 0})
    assert _call(sender, {"op": "abort", "rid": "q"}) == {}
    assert "error" in _call(receiver, {"op": "wait", "rid": "q", "timeout": 0.2})
    _call(receiver, {"op": "close", "rid": "q"})
    assert _call(sender, {"op": "stats"}) == {"transfers": 0}
    assert _call(receiver, {"op": "stats"})["sessions"] == 0
    assert "unknown command" in _call(receiver, {"op": "nonsense"})["error"]


class Echo:
    """A side service for the pipe test: answers each command with its own fields."""

    def __init__(self, runner) -> None:
        pass

    def handle(self, msg: dict, reply) -> None:
        if msg.get("op") == "boom":
            raise ValueError("no such thing")
        reply({"echo": msg})


async def test_commands_travel_over_the_rank_pipes_and_a_dead_rank_fails_its_pending_calls():
    reply_read, reply_write = os.pipe()
    code = (
        "import sys; from pdserve.engine.parallel.rank_commands import RankService; "
        f"s = RankService('tests.node_runtime.test_rank_kv:Echo', {reply_write}); s.start(None); "
        "s.serve(sys.stdin.buffer)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, pass_fds=(reply_write,))
    os.close(reply_write)
    commands = RankCommands()
    commands.attach(1, proc.stdin, reply_read)
    try:
        reply = await asyncio.wait_for(asyncio.wrap_future(commands.call(1, {"op": "hi", "n": 3})), 30)
        assert reply == {"echo": {"op": "hi", "n": 3}}
        reply = await asyncio.wait_for(asyncio.wrap_future(commands.call(1, {"op": "boom"})), 30)
        assert "no such thing" in reply["error"]
        proc.kill()
        proc.wait()
        with pytest.raises(RankFailure):
            await asyncio.wait_for(asyncio.wrap_future(commands.call(1, {"op": "late"})), 30)
    finally:
        if proc.poll() is None:
            proc.kill()
