"""Decode-side KV reuse: cache namespaces, where a prompt is prefilled, and that no block leaks."""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine, RequestStatus, SamplingParams
from pdserve.engine.block_keys import namespace_root, prompt_block_keys
from pdserve.engine.kv_connector import KvSource
from pdserve.engine.remote_prefill import DO_REMOTE_PREFILL, RemotePrefillPolicy

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [5 + i for i in range(22)]  # block size 4: 5 full blocks held once computed, the 6th partial


@pytest.fixture
def engine(tiny_model_dir):
    config = EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=64, block_size=4, preemption="never")
    engine = LLMEngine(config, connector=RemotePrefillPolicy())
    yield engine
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def plan_prefill(
    engine: LLMEngine,
    rid: str,
    prompt: list[int],
    *,
    local_max_tokens: int | None,
    reuse: bool = True,
    cache_salt: str | None = None,
) -> KvSource:
    """Admit as a decode node does: offered to a prefill node unless `local_max_tokens` is None (no
    prefill node), under the decode node's policy (`--kv-reuse`, `--local-prefill-max-tokens`)."""
    policy = engine.connector
    assert isinstance(policy, RemotePrefillPolicy)
    policy.reuse, policy.local_max_tokens = reuse, local_max_tokens or 0
    offered = {DO_REMOTE_PREFILL: local_max_tokens is not None}
    return engine.add_request(rid, prompt, GREEDY, cache_salt=cache_salt, kv_transfer_params=offered)


def run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(200):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            return tokens
    raise AssertionError("engine did not finish")


def test_stored_keys_are_the_keys_the_router_computes(engine):
    """The router roots keys on the node's compatibility string and the request's salt."""
    engine.add_request("a", PROMPT, GREEDY, cache_salt="tenant-a")
    run(engine)
    expected = prompt_block_keys(namespace_root(engine.kv_compatibility, "tenant-a"), PROMPT, 4)
    assert set(expected) <= engine.kv_events.snapshot().keys
    unsalted = prompt_block_keys(namespace_root(engine.kv_compatibility, None), PROMPT, 4)
    assert not set(unsalted) & engine.kv_events.snapshot().keys


def test_no_cross_salt_hit(engine):
    engine.add_request("a", PROMPT, GREEDY, cache_salt="tenant-a")
    run(engine)
    for rid, salt, hit in (("b", "tenant-b", 0), ("c", None, 0), ("d", "tenant-a", 20)):
        plan = plan_prefill(engine, rid, PROMPT, cache_salt=salt, local_max_tokens=1)
        assert plan.held_tokens == hit, (salt, plan)
        engine.abort(rid)
    run(engine)


def test_overlong_cache_salt_is_refused(engine):
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("a", PROMPT, GREEDY, cache_salt="x" * 257)
    with pytest.raises(ValueError, match="cache_salt"):
        plan_prefill(engine, "a", PROMPT, cache_salt="é" * 129, local_max_tokens=8)
    assert not engine.requests


def test_remote_plan_shares_held_blocks_and_allocates_only_the_rest(engine):
    engine.add_request("turn1", PROMPT, GREEDY)
    run(engine)
    cached = list(engine.block_manager.hash_to_block.values())
    turn2 = PROMPT + [900 + i for i in range(9)]  # 31 tokens: 5 held blocks + 3 missing
    plan = plan_prefill(engine, "turn2", turn2, local_max_tokens=4)
    assert plan.location == "remote" and plan.held_tokens == 20 and len(plan.block_ids) == 8
    assert set(plan.block_ids[:5]) <= set(cached) and not set(plan.block_ids[5:]) & set(cached)
    engine.complete_remote_prefill("turn2", 7, num_cached_tokens=24)
    assert engine.requests["turn2"].num_cached_tokens == 24
    run(engine)


def test_local_when_the_missing_part_is_short_or_no_prefill_node(engine):
    engine.add_request("turn1", PROMPT, GREEDY)
    expected = run(engine)
    plan = plan_prefill(engine, "short", PROMPT + [900, 901], local_max_tokens=8)
    assert plan == ("local", [], 20)
    plan = plan_prefill(engine, "none", PROMPT, local_max_tokens=None)
    assert plan.location == "local"
    assert plan_prefill(engine, "never", PROMPT, local_max_tokens=0).location == "remote"
    assert plan_prefill(engine, "off", PROMPT, reuse=False, local_max_tokens=64) == (
        "remote",
        engine.requests["off"].block_ids,
        0,
    )
    engine.abort("never")
    engine.abort("off")
    tokens = run(engine)
    assert tokens["none"] == expected["turn1"]


def test_failed_remote_prefill_falls_back_to_local_without_leaking(engine):
    engine.add_request("ref", PROMPT, GREEDY)
    expected = run(engine)["ref"]
    plan = plan_prefill(engine, "r", PROMPT, local_max_tokens=0)
    assert plan.location == "remote" and engine.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    engine.prefill_locally("r")
    assert run(engine)["r"] == expected
    with pytest.raises(KeyError):
        engine.prefill_locally("r")


def test_long_runs_are_published_in_chained_parts(monkeypatch):
    from pdserve.engine import block_manager
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.kv_events import KvEventLog

    monkeypatch.setattr(block_manager, "MAX_KEYS_PER_EVENT", 2)
    log = KvEventLog()
    bm = BlockManager(8, 2, events=log)
    tokens = list(range(11))
    blocks, _ = bm.allocate(tokens)
    bm.cache_full_blocks(tokens, blocks, len(tokens))
    events = log.since(0)
    assert [len(e.keys) for e in events] == [2, 2, 1]
    assert [e.parent_key for e in events[1:]] == [events[0].keys[-1], events[1].keys[-1]]
    bm.free_blocks(blocks)
