"""The prefill engine's half of a D->P pull (its `PullConnector`): which blocks it asks for, keying
them when they landed, freeing them unkeyed when not, and never holding a block past `finish`."""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.kv_connector import KvConnector, KvConnectors
from pdserve.engine.kv_pull import PullConnector

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
PROMPT = [5 + i for i in range(30)]  # block size 4: 7 full blocks and a partial one


@pytest.fixture
def pulls() -> PullConnector:
    return PullConnector()


@pytest.fixture
def engine(tiny_model_dir, pulls):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=32, block_size=4), connector=pulls)
    yield engine
    engine.check_integrity()
    assert not pulls.pending and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def finish(engine: LLMEngine, rid: str, prompt: list[int]) -> int:
    """Prefill `prompt` as a prefill node does; its cached tokens."""
    engine.add_request(rid, prompt, GREEDY, prefill_only=True)
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                engine.release(rid)
                return out.num_cached_tokens
    raise AssertionError("prefill did not finish")


def test_reserve_asks_only_for_the_missing_blocks_and_keys_them_when_landed(engine, pulls):
    finish(engine, "warm", PROMPT[:12])  # this engine holds the first 3 blocks
    got = pulls.reserve("r", PROMPT, 24, 1)
    assert got is not None
    fresh, first = got
    assert first == 3 and len(fresh) == 3  # blocks 3..5 of the 6 the decode node holds
    engine.check_integrity()  # the pull owns its blocks
    assert pulls.finish("r", True) == 3
    assert finish(engine, "next", PROMPT) == 24  # the next prefill hits every pulled block


def test_a_failed_pull_frees_unkeyed_and_is_recomputed(engine, pulls):
    fresh, first = pulls.reserve("r", PROMPT, 24, 1)
    assert first == 0 and len(fresh) == 6
    assert pulls.finish("r", False) == 0 and pulls.finish("r", False) == 0  # idempotent
    assert finish(engine, "next", PROMPT) == 0


def test_no_offer_when_too_little_is_missing_or_it_cannot_be_held(engine, pulls, tiny_model_dir):
    finish(engine, "warm", PROMPT[:20])  # 5 blocks keyed here
    assert pulls.reserve("r", PROMPT, 24, 2) is None  # only 1 of 6 missing, 2 required
    assert pulls.reserve("r", PROMPT, 24, 1) is not None
    with pytest.raises(ValueError, match="already pending"):
        pulls.reserve("r", PROMPT, 24, 1)
    pulls.finish("r", False)
    assert pulls.reserve("x", PROMPT, 10, 1) is None  # not block aligned
    assert pulls.reserve("x", PROMPT, 32, 1) is None  # not below the prompt length
    assert pulls.reserve("x", PROMPT * 10, 290, 1) is None  # more blocks than are free
    off_pulls = PullConnector()
    LLMEngine(
        EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=32, block_size=4, enable_prefix_caching=False),
        connector=off_pulls,
    )
    assert off_pulls.reserve("x", PROMPT, 24, 1) is None  # nothing could be keyed


def test_pending_blocks_are_owners_in_check_integrity(engine, pulls):
    finish(engine, "warm", PROMPT[:8])  # 2 blocks cached here: shared by the pull, ref counted
    fresh, first = pulls.reserve("r", PROMPT, 24, 1)
    assert first == 2 and pulls.owned_blocks() == {"pull:r": pulls.pending["r"].block_ids}
    assert pulls.owned_blocks()["pull:r"][first:] == fresh
    engine.check_integrity()  # the pull's blocks counted beside the requests'
    with pytest.raises(AssertionError, match="ref counts"):
        engine.block_manager.check_integrity({})  # without them: blocks nobody owns
    assert pulls.finish("r", False) == 0 and pulls.owned_blocks() == {}


def test_a_pull_pending_while_the_pool_fills_keeps_its_blocks(engine, pulls):
    fresh, _ = pulls.reserve("r", PROMPT, 24, 1)
    tensor = engine.kv_pool.tensor  # [layers, blocks, planes, heads, block_size, head_dim]
    tensor[:, fresh] = 7.0  # what the decode node wrote
    # 4 requests of 12 blocks each want 48 of the 26 blocks left: they queue and preempt one another
    others = {f"o{i}": [100 + 50 * i + j for j in range(40)] for i in range(4)}
    for rid, prompt in others.items():
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    done: set[str] = set()
    least_free = engine.block_manager.num_free_blocks
    for _ in range(200):
        for out in engine.step():
            done |= {out.request_id} if out.finished else set()
        least_free = min(least_free, engine.block_manager.num_free_blocks)
        assert not {b for r in engine.requests.values() for b in r.block_ids} & set(fresh)
        engine.check_integrity()
        if done == set(others):
            break
    assert done == set(others) and least_free < 4  # the pool was full around the pull's blocks
    assert bool((tensor[:, fresh] == 7.0).all())  # no write landed in a reserved block
    assert pulls.finish("r", True) == 6
    assert finish(engine, "next", PROMPT) == 24  # the pulled prefix is an ordinary cached prefix now


def test_no_offer_while_admitted_requests_need_the_room(tiny_model_dir):
    pulls = PullConnector()
    config = EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=32, block_size=4, preemption="never")
    engine = LLMEngine(config, connector=pulls)
    engine.add_request("big", PROMPT, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    assert engine.block_manager.num_free_blocks == 32  # queued, holding nothing yet, but 28 blocks promised
    assert pulls.reserve("r", [1000 + t for t in PROMPT], 24, 1) is None  # 6 blocks: not beyond the promise
    engine.abort("big")
    engine.step()
    assert pulls.reserve("r", [1000 + t for t in PROMPT], 24, 1) is not None
    pulls.finish("r", False)
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == 32


def test_pulls_through_a_chain_of_connectors(tiny_model_dir):
    """A prefill node chains its layer streamer and its pull connector: both new hooks reach it."""
    pulls = PullConnector()
    engine = LLMEngine(
        EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=32, block_size=4),
        connector=KvConnectors(KvConnector(), pulls),
    )
    fresh, first = pulls.reserve("r", PROMPT, 24, 1)
    assert first == 0 and engine.connector.owned_blocks() == {"pull:r": fresh}
    engine.check_integrity()
    assert pulls.finish("r", True) == 6
    assert finish(engine, "next", PROMPT) == 24
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == 32
