"""The prefill engine's half of a D->P pull: which blocks it asks for, keying them when they
landed, freeing them unkeyed when not, and never holding a block past `pulls.finish`."""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
PROMPT = [5 + i for i in range(30)]  # block size 4: 7 full blocks and a partial one


@pytest.fixture
def engine(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=32, block_size=4))
    yield engine
    engine.check_integrity()
    assert not engine.pulls.pulls and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def finish(engine: LLMEngine, rid: str, prompt: list[int]) -> int:
    """Prefill `prompt` as a prefill node does; its cached tokens."""
    engine.add_request(rid, prompt, GREEDY, prefill_only=True)
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                engine.release(rid)
                return out.num_cached_tokens
    raise AssertionError("prefill did not finish")


def test_reserve_asks_only_for_the_missing_blocks_and_keys_them_when_landed(engine):
    finish(engine, "warm", PROMPT[:12])  # this engine holds the first 3 blocks
    got = engine.pulls.reserve("r", PROMPT, 24, 1)
    assert got is not None
    fresh, first = got
    assert first == 3 and len(fresh) == 3  # blocks 3..5 of the 6 the decode node holds
    engine.check_integrity()  # the pull owns its blocks
    assert engine.pulls.finish("r", True) == 3
    assert finish(engine, "next", PROMPT) == 24  # the next prefill hits every pulled block


def test_a_failed_pull_frees_unkeyed_and_is_recomputed(engine):
    fresh, first = engine.pulls.reserve("r", PROMPT, 24, 1)
    assert first == 0 and len(fresh) == 6
    assert engine.pulls.finish("r", False) == 0 and engine.pulls.finish("r", False) == 0  # idempotent
    assert finish(engine, "next", PROMPT) == 0


def test_no_offer_when_too_little_is_missing_or_it_cannot_be_held(engine, tiny_model_dir):
    finish(engine, "warm", PROMPT[:20])  # 5 blocks keyed here
    assert engine.pulls.reserve("r", PROMPT, 24, 2) is None  # only 1 of 6 missing, 2 required
    assert engine.pulls.reserve("r", PROMPT, 24, 1) is not None
    with pytest.raises(ValueError, match="already pending"):
        engine.pulls.reserve("r", PROMPT, 24, 1)
    engine.pulls.finish("r", False)
    assert engine.pulls.reserve("x", PROMPT, 10, 1) is None  # not block aligned
    assert engine.pulls.reserve("x", PROMPT, 32, 1) is None  # not below the prompt length
    assert engine.pulls.reserve("x", PROMPT * 10, 290, 1) is None  # more blocks than are free
    off = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=32, block_size=4, enable_prefix_caching=False))
    assert off.pulls.reserve("x", PROMPT, 24, 1) is None  # nothing could be keyed
