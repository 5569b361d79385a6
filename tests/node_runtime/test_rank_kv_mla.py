"""The per-rank CacheStore endpoints (node_runtime.rank_kv) with MLA's one-plane pools: the one latent
"head" is replicated on every rank, so a prefill rank writes whole latent blocks into each decode rank,
P(TP=1) into D(TP=2) here, each decode rank ending with the full latent."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pdserve.node_runtime.rank_kv import ReceiverRank, SenderRank
from tests.node_runtime.test_rank_kv import _batch, _call

LAYERS, BLOCKS, BLOCK_SIZE, LATENT = 2, 8, 4, 48


def _latent_runner(rank: int, size: int, fill: bool) -> SimpleNamespace:
    """A rank's runner as the endpoint reads it: a [L, N, 1, 1, B, D] pool and one KV head (the latent)."""
    shape = (LAYERS, BLOCKS, 1, 1, BLOCK_SIZE, LATENT)
    pool = SimpleNamespace(
        tensor=torch.randn(shape) if fill else torch.zeros(shape),
        num_layers=LAYERS,
        num_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        head_dim=LATENT,
        block_bytes=BLOCK_SIZE * LATENT * 4,
    )
    return SimpleNamespace(
        kv_pool=pool, tp=SimpleNamespace(rank=rank, size=size), model_config=SimpleNamespace(num_key_value_heads=1)
    )


def test_one_prefill_rank_fills_every_decode_rank_with_the_whole_latent():
    sender = SenderRank(_latent_runner(0, 1, fill=True))
    receivers = [ReceiverRank(_latent_runner(q, 2, fill=False)) for q in range(2)]
    start = {"transport": "tcp", "host": "127.0.0.1", "secret": "s"}
    for receiver in receivers:
        assert _call(receiver, {"op": "start", **start})["endpoint"].startswith("127.0.0.1:")
    assert _call(sender, {"op": "start", **start}) == {}
    creds = [_call(r, {"op": "open", "rid": "r", "blocks": [5, 6], "timeout": 10})["creds"] for r in receivers]
    assert _call(sender, {"op": "open", "rid": "r", "creds": creds, "held_blocks": 0}) == {"transfers": 2}
    for layer in range(LAYERS):
        sender.connector.save_layer(layer, _batch("r", [1, 2]))
    assert "error" not in _call(sender, {"op": "finish", "rid": "r", "timeout": 10})
    src = sender.runner.kv_pool.tensor
    for receiver in receivers:
        assert _call(receiver, {"op": "wait", "rid": "r", "timeout": 10}) == {}
        closed = _call(receiver, {"op": "close", "rid": "r"})
        dst = receiver.runner.kv_pool.tensor
        assert torch.equal(dst[:, [5, 6]], src[:, [1, 2]])  # the whole latent of both blocks
        assert not dst[:, [0, 1, 2, 3, 4, 7]].any()
        assert closed["recv_bytes"] == LAYERS * 2 * BLOCK_SIZE * LATENT * 4  # one plane: no K/V pair
        assert _call(receiver, {"op": "stats"})["sessions"] == 0
