"""The host KV tier below the pool (--kv-offloading-size): what goes down, what comes back, and that
a restored block is the block that was stored."""

from __future__ import annotations

import argparse
import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.block_keys import prompt_block_keys
from pdserve.engine.kv_connector import KvConnectors
from pdserve.engine.kv_events import Medium
from pdserve.engine.kv_namespace import request_root
from pdserve.engine.kv_tier import HostKvTier
from pdserve.engine.remote_prefill import DO_REMOTE_PREFILL, RemotePrefillPolicy
from pdserve.node_runtime.tier_metrics import TierCollector

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 4
POOL_BLOCKS = 24
PROMPT = [5 + i for i in range(61)]  # 15 full blocks before the last token's


def others(n: int) -> list[list[int]]:
    """Prompts sharing nothing with PROMPT or each other: running them evicts PROMPT's blocks."""
    return [[300 + k * 70 + i for i in range(61)] for k in range(n)]


def run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(500):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            return tokens
    raise AssertionError("engine did not finish")


def settle(tier: HostKvTier) -> None:
    """Wait until the writer has stored everything queued (it runs beside the engine thread)."""
    for _ in range(500):
        if not tier._pending:
            return
        time.sleep(0.01)
    raise AssertionError("the tier's writer did not finish")


@pytest.fixture
def make(tiny_model_dir):
    engines: list[LLMEngine] = []

    def build(offload: int | None = 64 << 20, connector=None, **kw) -> LLMEngine:
        config = EngineConfig(
            model_dir=tiny_model_dir, num_kv_blocks=POOL_BLOCKS, block_size=BS, kv_offloading_bytes=offload, **kw
        )
        engine = LLMEngine(config, **({"connector": connector} if connector is not None else {}))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:  # every test leaves every block free and owned as the statuses say
        assert not engine.has_unfinished_requests()
        engine.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        engine.close()


def test_an_evicted_prefix_comes_back_from_the_host_tier_with_the_same_output(make):
    expected = run_one(make(offload=None), PROMPT)
    engine = make()
    tier = engine.tier
    assert tier is not None and tier.num_slots > 0
    assert run_one(engine, PROMPT) == expected
    settle(tier)
    assert tier.stats.stored_blocks == 16  # 61 prompt + 4 output tokens: 16 full blocks went down
    for i, prompt in enumerate(others(3)):  # fill the pool with other prompts: PROMPT's blocks are evicted
        run_one(engine, prompt, f"o{i}")
    settle(tier)
    assert not engine.block_manager.prefix_hits(PROMPT)  # gone from the pool
    engine.add_request("again", PROMPT, GREEDY)
    outs = run_outputs(engine)
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert outs[-1].num_cached_tokens == 60  # 15 blocks restored, only the last token's block computed
    assert tier.stats.restored_blocks == 15 and tier.stats.hit_requests == 1
    pool = engine.runner.kv_pool
    assert tier.stats.restored_bytes == 15 * pool.block_bytes * pool.num_layers
    assert tier.stats.stored_bytes >= 16 * pool.block_bytes * pool.num_layers
    assert sum(tier.stats.restore_latency) == 1
    root = request_root(engine.kv_compatibility, None)
    in_host = engine.kv_events.snapshot().tiers[Medium.HOST]  # what the router hears the tier holds
    assert set(prompt_block_keys(root, PROMPT, BS, 15)) <= in_host and len(in_host) <= tier.num_slots


def test_salted_blocks_are_not_restored_under_another_salt(make):
    engine = make()
    run_one(engine, PROMPT, salt="tenant-a")
    for i, prompt in enumerate(others(3)):
        run_one(engine, prompt, f"o{i}")
    settle(engine.tier)
    engine.add_request("b", PROMPT, GREEDY, cache_salt="tenant-b")
    assert run_outputs(engine)[-1].num_cached_tokens == 0
    assert engine.tier.stats.restored_blocks == 0
    engine.add_request("a", PROMPT, GREEDY, cache_salt="tenant-a")
    assert run_outputs(engine)[-1].num_cached_tokens == 60


def test_a_full_tier_drops_its_least_recently_used_blocks_and_outputs_stay_the_same(make, tiny_model_dir):
    reference = make(offload=None)
    expected = {i: run_one(reference, p, f"r{i}") for i, p in enumerate([PROMPT, *others(3)])}
    probe = make()
    slot_bytes = probe.kv_pool.block_bytes * probe.kv_pool.num_layers
    engine = make(offload=20 * slot_bytes)  # 20 blocks: one prompt and a bit
    assert engine.tier.num_slots == 20
    for i, prompt in enumerate([PROMPT, *others(3)]):
        assert run_one(engine, prompt, f"p{i}") == expected[i]
        settle(engine.tier)
    assert engine.tier.stats.evicted_blocks > 0
    for i, prompt in enumerate([PROMPT, *others(3)]):  # whatever each finds in pool or tier, the text is the same
        assert run_one(engine, prompt, f"q{i}") == expected[i]


def test_a_block_is_not_overwritten_before_its_copy_to_the_host_is_done(make, monkeypatch):
    engine = make()
    tier = engine.tier
    gate, opened_at = threading.Event(), []
    store = HostKvTier._store

    def slow_store(self, block, key):
        gate.wait()
        store(self, block, key)

    monkeypatch.setattr(HostKvTier, "_store", slow_store)
    run_one(engine, PROMPT)  # its 16 blocks are queued, the writer holds at the gate
    blocks = list(engine.block_manager.hash_to_block.values())
    before = engine.kv_pool.tensor[:, blocks].clone()

    def open_gate() -> None:
        time.sleep(0.3)
        opened_at.append(time.monotonic())
        gate.set()

    threading.Thread(target=open_gate).start()
    engine.add_request("next", others(1)[0], GREEDY)
    engine.step()  # allocating its blocks reuses PROMPT's freed ones: each waits for its copy first
    allocated_at = time.monotonic()
    run(engine)
    assert opened_at and allocated_at >= opened_at[0]
    settle(tier)
    with tier._lock:
        stored = torch.stack([tier.store[tier._slots[engine_key]] for engine_key in tier._slots][:16])
    assert torch.equal(stored.transpose(0, 1), before)  # the tier holds the blocks as they were


def test_a_decode_node_restores_from_its_tier_before_asking_a_prefill_node(make):
    engine = make(connector=RemotePrefillPolicy(), preemption="never")
    assert isinstance(engine.connector, KvConnectors)
    run_one(engine, PROMPT)
    for i, prompt in enumerate(others(3)):
        run_one(engine, prompt, f"o{i}")
    settle(engine.tier)
    turn = PROMPT + [900 + i for i in range(12)]
    source = engine.add_request("turn", turn, GREEDY, kv_transfer_params={DO_REMOTE_PREFILL: True})
    # the tier restored the 60 held tokens into the pool; the prefill node fills only the rest
    assert source.location == "remote" and source.held_tokens == 60
    # the node may send the held prefix to a prefill node (a D->P pull) before any step: it has landed
    tier = engine.tier
    assert tier.restores.pending == 0 and tier.stats.restored_blocks == 15
    keys = prompt_block_keys(request_root(engine.kv_compatibility, None), PROMPT, BS, 15)
    with tier._lock:
        stored = torch.stack([tier.store[tier._slots[key]] for key in keys])
    assert torch.equal(engine.kv_pool.tensor[:, source.block_ids[:15]], stored.transpose(0, 1))
    engine.abort("turn")
    run(engine)


def test_bad_offloading_sizes_are_refused_naming_the_flag(tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-offloading-size must be positive"):
        EngineConfig(model_dir=tiny_model_dir, kv_offloading_bytes=0)
    with pytest.raises(ValueError, match="--kv-offloading-size 16 bytes holds no KV block"):
        LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=8, kv_offloading_bytes=16))
    from pdserve.commands.memory_args import offloading_size

    assert offloading_size("0.5") == 2**29 and offloading_size("512MiB") == 2**29
    for bad in ("-1", "0", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            offloading_size(bad)


def test_the_tier_series_are_exported(make):
    engine = make()
    run_one(engine, PROMPT)
    settle(engine.tier)
    registry = CollectorRegistry()
    TierCollector(engine.tier.stats, "decode", "m", registry)
    labels = {"role": "decode", "model_name": "m", "op": "stored"}
    assert registry.get_sample_value("pdserve_kv_offload_blocks_total", labels) == 16
    assert (
        registry.get_sample_value("pdserve_kv_offload_hit_requests_total", {"role": "decode", "model_name": "m"}) == 0
    )
    engine.tier.stats.restore_fallbacks = 2
    assert (
        registry.get_sample_value("pdserve_kv_offload_restore_fallbacks_total", {"role": "decode", "model_name": "m"})
        == 2
    )


def evicted(make, **kw) -> tuple[LLMEngine, list[int]]:
    """An engine whose tier holds PROMPT's blocks and whose pool no longer does, and PROMPT's
    tokens from an engine without a tier."""
    expected = run_one(make(offload=None), PROMPT)
    engine = make(**kw)
    assert run_one(engine, PROMPT) == expected
    for i, prompt in enumerate(others(3)):
        run_one(engine, prompt, f"o{i}")
    settle(engine.tier)
    assert not engine.block_manager.prefix_hits(PROMPT)
    return engine, expected


def check_layers_at_compute(engine: LLMEngine, monkeypatch, order: list[tuple[str, int]]) -> None:
    """Before each layer's attention (after the tier's `wait_for_layer`), PROMPT's restored blocks
    of that layer must already hold what the tier stores: checked there, and recorded in `order`."""
    tier = engine.tier
    keys = prompt_block_keys(request_root(engine.kv_compatibility, None), PROMPT, BS, 15)
    wait_for_layer = tier.wait_for_layer

    def waited(layer: int) -> None:
        wait_for_layer(layer)
        bm = engine.block_manager
        if all(key in bm.hash_to_block for key in keys):
            blocks = [bm.hash_to_block[key] for key in keys]
            with tier._lock:
                stored = tier.store[[tier._slots[key] for key in keys], layer]
            assert torch.equal(engine.kv_pool.tensor[layer, blocks], stored), f"layer {layer} not landed"
        order.append(("compute", layer))

    monkeypatch.setattr(tier, "wait_for_layer", waited)


def test_a_restore_lands_layer_by_layer_while_the_first_layers_compute(make, monkeypatch):
    engine, expected = evicted(make)
    tier = engine.tier
    layers = engine.kv_pool.num_layers
    assert layers >= 2 and engine.connector is tier
    order: list[tuple[str, int]] = []
    lock = threading.Lock()

    def slow_copy(layer, dst, src):  # a slow link: 5 ms per block and layer
        time.sleep(0.005)
        dst.copy_(src)
        with lock:
            order.append(("landed", layer))

    tier.restores.copy = slow_copy
    check_layers_at_compute(engine, monkeypatch, order)
    engine.add_request("again", PROMPT, GREEDY)
    assert not order and tier.restores.pending == 1  # admission only recorded it
    outs = run_outputs(engine)
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert outs[-1].num_cached_tokens == 60
    assert order.count(("landed", 0)) == 15 and len([e for e in order if e[0] == "landed"]) == 15 * layers
    first_compute = {layer: order.index(("compute", layer)) for layer in range(layers)}
    last_landed = {layer: max(i for i, e in enumerate(order) if e == ("landed", layer)) for layer in range(layers)}
    for layer in range(layers):  # no layer's attention before its KV landed
        assert first_compute[layer] > last_landed[layer], (layer, order)
    assert first_compute[0] < last_landed[layers - 1]  # layer 0 computed while later layers were copied
    assert tier.restores.pending == 0 and tier.stats.hit_requests == 1 and tier.stats.restore_fallbacks == 0
    # the latency runs from admission to the last layer landing: it spans every slow copy
    assert sum(tier.stats.restore_latency) == 1 and tier.stats.restore_seconds >= 15 * layers * 0.005


def test_a_copy_that_fails_mid_restore_is_redone_with_the_same_output_and_no_leak(make, monkeypatch):
    engine, expected = evicted(make)
    tier = engine.tier
    failed: list[str] = []

    def flaky_copy(layer, dst, src):  # the worker's copy of layer 2 fails once
        time.sleep(0.002)
        if layer == 2 and not failed:
            failed.append(threading.current_thread().name)
            raise RuntimeError("injected copy failure")
        dst.copy_(src)

    tier.restores.copy = flaky_copy
    order: list[tuple[str, int]] = []
    check_layers_at_compute(engine, monkeypatch, order)
    engine.add_request("again", PROMPT, GREEDY)
    outs = run_outputs(engine)
    assert failed == ["host KV tier-restore"]  # it failed on the worker, mid-restore
    assert ("compute", engine.kv_pool.num_layers - 1) in order  # every layer was checked when computed
    assert [t for o in outs for t in o.new_token_ids] == expected
    assert outs[-1].num_cached_tokens == 60
    assert tier.stats.restore_fallbacks == 1 and tier.stats.hit_requests == 1 and tier.stats.restore_failures == 0
    assert tier.restores.pending == 0 and not tier._pins
    engine.check_integrity()  # (and the fixture: every block free, owned as the statuses say)


def test_a_slot_being_restored_from_is_never_evicted(make):
    probe = make(offload=None)
    slot_bytes = probe.kv_pool.block_bytes * probe.kv_pool.num_layers
    engine, expected = evicted(make, offload=70 * slot_bytes)  # 64 blocks stored: no eviction yet
    tier = engine.tier
    assert tier.stats.evicted_blocks == 0
    engine.add_request("again", PROMPT, GREEDY)  # its 15 slots are pinned until the restore lands
    keys = prompt_block_keys(request_root(engine.kv_compatibility, None), PROMPT, BS, 15)
    with tier._lock:
        slots = [tier._slots[key] for key in keys]
        before = tier.store[slots].clone()
    for i in range(100):  # the writer stores 100 other blocks meanwhile: the tier turns over
        tier._store(0, (1 << 62) + i)
    assert tier.stats.evicted_blocks >= 94
    with tier._lock:
        assert [tier._slots.get(key) for key in keys] == slots
        assert torch.equal(tier.store[slots], before)
    assert [t for o in run_outputs(engine) for t in o.new_token_ids] == expected
    assert not tier._pins  # released once landed: evictable again


def run_outputs(engine: LLMEngine) -> list:
    outs = []
    for _ in range(500):
        outs += engine.step()
        if not engine.has_unfinished_requests():
            return outs
    raise AssertionError("engine did not finish")


def run_one(engine: LLMEngine, prompt: list[int], rid: str = "a", salt: str | None = None) -> list[int]:
    engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
    return run(engine)[rid]


def test_restore_latency_is_a_histogram_and_bytes_are_counted():
    from pdserve.engine.kv_tier import TierStats

    stats = TierStats()
    stats.stored(4096)
    stats.restored(2, 8192, 0.003)  # in the 0.005 bucket
    stats.restored(1, 4096, 9.0)  # over the last bound
    registry = CollectorRegistry()
    TierCollector(stats, "prefill", "m", registry)
    labels = {"role": "prefill", "model_name": "m"}

    def bucket(le: str) -> float | None:
        return registry.get_sample_value("pdserve_kv_offload_restore_latency_seconds_bucket", {**labels, "le": le})

    assert bucket("0.0025") == 0 and bucket("0.005") == 1 and bucket("5.0") == 1 and bucket("+Inf") == 2
    assert registry.get_sample_value("pdserve_kv_offload_restore_latency_seconds_sum", labels) == pytest.approx(9.003)
    assert registry.get_sample_value("pdserve_kv_offload_bytes_total", {**labels, "op": "restored"}) == 12288
    assert registry.get_sample_value("pdserve_kv_offload_bytes_total", {**labels, "op": "stored"}) == 4096
    assert stats.restored_blocks == 3 and stats.hit_requests == 2
