"""The KV tiers of a tensor-parallel engine (TP=2, two processes): each rank keeps its heads' share of
every block below the pool, rank 0 deciding, and a restore gives the output the same prompt gives
with no tier at all. A rank that lacks its share, or holds a corrupt one, costs a recompute with the
same output, never a wrong token or a leaked block."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from pdserve.engine import EngineConfig, LLMEngine
from pdserve.engine.block_keys import prompt_block_keys
from pdserve.engine.kv_namespace import request_root
from pdserve.engine.kv_shared_store import SharedKvStore
from pdserve.engine.kv_tier_rank_service import RankTiers
from pdserve.engine.kv_tier_ranks import TierRanks, shard_suffix

from tests.engine.test_kv_tier import BS, GREEDY, POOL_BLOCKS, PROMPT, others  # the same workload as TP=1's


def serve(engine: LLMEngine, rid: str, prompt: list[int] = PROMPT) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one request run alone to its end; nothing leaked."""
    engine.add_request(rid, prompt, GREEDY)
    tokens: list[int] = []
    cached = 0
    for _ in range(500):
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
        if not engine.has_unfinished_requests():
            break
    else:
        raise AssertionError("engine did not finish")
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return tokens, cached


def settle(pending: dict) -> None:
    for _ in range(1000):
        if not pending:
            return
        time.sleep(0.01)
    raise AssertionError("the tier's writer did not finish")


@pytest.fixture
def make(tiny_model_dir):
    engines: list[LLMEngine] = []

    def build(**kw) -> LLMEngine:
        config = EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=POOL_BLOCKS, block_size=BS, **kw)
        engine = LLMEngine(config)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[int]:
    """PROMPT's output on one process, with no tier."""
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=POOL_BLOCKS, block_size=BS))
    try:
        return serve(engine, "ref")[0]
    finally:
        engine.close()


def test_a_tp2_host_tier_restores_each_ranks_share(make, reference):
    engine = make(tensor_parallel_size=2, kv_offloading_bytes=64 << 20)
    tier = engine.tier
    assert tier is not None and tier.ranks is not None and tier.ranks.ranks == [1]
    assert serve(engine, "first")[0] == reference
    settle(tier._pending)
    assert tier.stats.stored_blocks == 16 and tier.stats.dropped_blocks == 0
    for i, prompt in enumerate(others(3)):  # PROMPT's blocks leave the pool
        serve(engine, f"o{i}", prompt)
    settle(tier._pending)
    assert not engine.block_manager.prefix_hits(PROMPT)
    tokens, cached = serve(engine, "again")
    assert tokens == reference  # a wrong share on rank 1 would change the all-reduced logits
    assert cached == 60 and tier.stats.restored_blocks == 15 and tier.stats.restore_failures == 0
    assert not tier._pins


def test_a_rank_that_cannot_copy_its_share_costs_a_recompute(make, reference):
    engine = make(tensor_parallel_size=2, kv_offloading_bytes=64 << 20)
    tier = engine.tier
    assert tier is not None
    serve(engine, "first")
    for i, prompt in enumerate(others(3)):
        serve(engine, f"o{i}", prompt)
    settle(tier._pending)
    calls = tier.ranks.commands.call

    def refusing(rank, msg):  # rank 1's copy into the pool fails: it is told slots it does not have
        if msg["op"] == "tier_load":
            msg = {**msg, "slots": [10**6] * len(msg["slots"])}
        return calls(rank, msg)

    tier.ranks.commands.call = refusing
    try:
        tokens, cached = serve(engine, "again")
    finally:
        tier.ranks.commands.call = calls
    assert tokens == reference and cached == 0  # recomputed on every rank
    assert tier.stats.restore_failures == 1 and tier.stats.restored_blocks == 0
    assert not tier._pins  # the slots were released


def test_a_tp2_store_restores_each_ranks_records_and_refuses_a_corrupt_share(make, reference, tmp_path):
    url = f"file://{tmp_path / 'store'}"
    first = make(tensor_parallel_size=2, kv_store=url)
    assert serve(first, "first")[0] == reference
    # rank 0's drain waits for rank 1's writer too (it writes its records after answering rank 0)
    assert first.store is not None and first.store.drain(30)
    files = sorted((tmp_path / "store").glob("*/*.kvb"))
    rank0 = [f for f in files if f.stem.endswith(shard_suffix(0, 2))]
    rank1 = [f for f in files if f.stem.endswith(shard_suffix(1, 2))]
    assert len(rank0) >= 15 and len(rank1) == len(rank0) and len(files) == len(rank0) + len(rank1)
    # a TP=1 node does not read a share as if it were the block
    whole = make(kv_store=url)
    assert serve(whole, "whole") == (reference, 0)
    assert whole.store is not None and whole.store.stats.hit_requests == 0
    second = make(tensor_parallel_size=2, kv_store=url)  # a second node, the same directory
    serve(second, "other", others(1)[0])  # its free blocks hold other KV (a zeroed share could pass unseen)
    tokens, cached = serve(second, "second")
    assert tokens == reference and cached == 60
    assert second.store is not None and second.store.stats.restored_blocks == 15
    # one bit flipped in a share rank 1 reads: refused there, the whole prompt recomputed, same output
    key = prompt_block_keys(request_root(first.kv_compatibility, None), PROMPT, BS, 1)[0]
    victim = next(f for f in rank1 if f.stem == f"{key:016x}{shard_suffix(1, 2)}")  # the first block's
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    third = make(tensor_parallel_size=2, kv_store=url)
    tokens, cached = serve(third, "third")
    assert tokens == reference and cached == 0
    assert third.store is not None and third.store.stats.restore_failures == 1


class _SlowStore:
    """A rank's store whose writes wait for `release` (a writer far behind)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list[int] = []

    def write_record(self, key: int, parent: int, tokens: list[int], payload: bytes) -> None:
        assert self.release.wait(30)
        self.written.append(key)


def test_a_ranks_drain_is_answered_only_after_its_queued_writes(tiny_model_dir):
    """Rank 1 writes its records after answering rank 0's copy-out: a node stopping must wait for
    them (`store_drain`), or that rank's last records are lost and their restores recompute."""
    config = EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=POOL_BLOCKS, block_size=BS)
    engine = LLMEngine(config)
    try:
        tiers = RankTiers(config, engine.runner, 1)
        store = tiers.store = _SlowStore()
        answers: list[tuple[str, dict]] = []
        for key in (7, 8):
            msg = {"op": "store_offload", "block": key - 7, "key": key, "parent": 0, "tokens": [1] * BS}
            tiers.handle(msg, lambda a, k=key: answers.append((f"offload {k}", a)))
        tiers.handle({"op": "store_drain"}, lambda a: answers.append(("drain", a)))
        time.sleep(0.2)
        assert [name for name, _ in answers] == ["offload 7", "offload 8"]  # copied out; not yet written
        store.release.set()
        for _ in range(300):
            if len(answers) == 3:
                break
            time.sleep(0.01)
        assert answers[-1] == ("drain", {"ok": True}) and store.written == [7, 8]
    finally:
        engine.close()


class _Ranks:
    """Rank 0's view of ranks that answer `store_drain` with `answer` (None: never)."""

    def __init__(self, answer: dict | None) -> None:
        self.answer = answer
        self.sent: list[dict] = []

    def all(self, msg: dict, timeout_s: float) -> bool:
        self.sent.append(msg)
        return self.answer is not None and TierRanks.settled([_done(self.answer)], timeout_s)


def _done(answer: dict) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    fut.set_result(answer)
    return fut


@pytest.mark.parametrize("answer, drained", [({"ok": True}, True), ({"error": "hung"}, False), (None, False)])
def test_rank_zeros_drain_waits_for_the_other_ranks_writers(tmp_path, answer, drained):
    ranks = _Ranks(answer)
    store = SharedKvStore(f"file://{tmp_path / 'store'}", "compat", shard=shard_suffix(0, 2), ranks=ranks)
    try:
        assert store.drain(1.0) is drained
        assert ranks.sent == [{"op": "store_drain"}]
    finally:
        store.ranks = None
        store.close()
