"""The shared KV store (--kv-store file:///PATH): a prefix one engine computed is restored by another
that mounts the same directory, the restored block is the block that was stored, and any store
fault (a corrupt or foreign file, a slow or vanished store) costs a recompute with identical output,
never a wrong token, a hang or a leaked block."""

from __future__ import annotations

import shutil
import time

import pytest
from prometheus_client import CollectorRegistry

from pdserve.engine.kv_events import KvEventKind, Medium
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine import kv_shared_store, kv_store_backends
from pdserve.engine.kv_shared_store import SharedKvStore
from pdserve.node_runtime.tier_metrics import store_collector

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BS = 4
PROMPT = [5 + i for i in range(61)]  # 15 full blocks before the last token's


def run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(500):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            return tokens
    raise AssertionError("engine did not finish")


@pytest.fixture
def make(tiny_model_dir, tmp_path):
    engines: list[LLMEngine] = []
    url = f"file://{tmp_path / 'store'}"

    def build(store: str | None = url, **kw) -> LLMEngine:
        config = EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=48, block_size=BS, kv_store=store, **kw)
        engine = LLMEngine(config)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


def serve(engine: LLMEngine, rid: str, prompt=PROMPT, **kw) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one request run alone to its end."""
    engine.add_request(rid, prompt, GREEDY, **kw)
    cached = engine.requests[rid].num_cached_tokens if rid in engine.requests else 0
    tokens = run(engine)[rid]
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked
    return tokens, cached


def computed(engine: LLMEngine) -> tuple[list[int], SharedKvStore]:
    """Serve PROMPT on `engine` and wait until its blocks are in the store."""
    tokens, _ = serve(engine, "first")
    assert engine.store is not None and engine.store.drain(30)
    assert engine.store.stats.stored_blocks >= 15
    in_store = engine.kv_events.snapshot().tiers[Medium.STORE]  # what the router hears was written
    assert 15 <= len(in_store) <= engine.store.stats.stored_blocks
    return tokens, engine.store


def test_another_engine_restores_what_one_computed(make):
    reference = serve(make(store=None), "ref")[0]
    tokens, _ = computed(make())
    other = make()  # a second node: an empty pool, the same directory
    again, _ = serve(other, "second")
    assert tokens == again == reference
    assert other.store is not None and other.store.stats.restored_blocks == 15
    assert other.store.stats.hit_requests == 1 and other.store.stats.corrupt_blocks == 0
    registry = CollectorRegistry()  # what the node exports of it
    store_collector(other.store.stats, "decode", "m", registry)
    labels = {"role": "decode", "model_name": "m"}
    assert registry.get_sample_value("pdserve_kv_store_blocks_total", {**labels, "op": "restored"}) == 15
    assert registry.get_sample_value("pdserve_kv_store_hit_requests_total", labels) == 1
    pool = other.store.pool
    assert pool is not None
    block_bytes = pool.block_bytes * pool.num_layers
    restored = registry.get_sample_value("pdserve_kv_store_bytes_total", {**labels, "op": "restored"})
    assert restored == 15 * block_bytes > 0  # the payloads, without their record headers
    assert other.store.drain(30)
    written = other.store.stats.stored_blocks  # the blocks it computed itself (the prompt's last, the output)
    stored = registry.get_sample_value("pdserve_kv_store_bytes_total", {**labels, "op": "stored"})
    assert written > 0 and stored > written * block_bytes  # whole records: payload and header
    assert registry.get_sample_value("pdserve_kv_store_restore_latency_seconds_count", labels) == 1
    assert registry.get_sample_value("pdserve_kv_store_restore_latency_seconds_bucket", {**labels, "le": "+Inf"}) == 1
    assert registry.get_sample_value("pdserve_kv_store_timeouts_total", labels) == 0


def test_a_store_restore_lands_layer_by_layer_and_a_failed_copy_is_redone(make):
    tokens, _ = computed(make())
    other = make()
    assert other.store is not None and other.store.restores is not None
    failed: list[int] = []

    def flaky_copy(layer, dst, src):  # the copy of layer 1 into the pool fails once
        if layer == 1 and not failed:
            failed.append(layer)
            raise RuntimeError("injected copy failure")
        dst.copy_(src)

    other.store.restores.copy = flaky_copy
    again, _ = serve(other, "second")  # (serve checks integrity and that no block leaked)
    assert failed and again == tokens
    stats = other.store.stats
    assert stats.restored_blocks == 15 and stats.restore_fallbacks == 1 and stats.restore_failures == 0
    assert other.store.restores.pending == 0


def test_a_salted_prefix_is_reachable_only_with_its_salt(make):
    first = make()
    serve(first, "salted", cache_salt="tenant-a")
    assert first.store.drain(30)
    other = make()
    serve(other, "no-salt")
    assert other.store.stats.restored_blocks == 0
    serve(other, "same-salt", prompt=PROMPT, cache_salt="tenant-a")
    assert other.store.stats.restored_blocks == 15


def test_a_corrupt_or_foreign_file_is_refused_and_recomputed(make, tmp_path):
    tokens, store = computed(make())
    files = sorted(store.backend.path.glob("*/*.kvb"))
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of KV
    victim.write_bytes(bytes(data))
    other = make()
    again, _ = serve(other, "second")
    assert again == tokens
    assert other.store.stats.corrupt_blocks == 1 and other.store.stats.restore_failures == 1
    assert [e.medium for e in other.kv_events.since(0) or [] if e.kind == KvEventKind.REMOVED] == [Medium.STORE]
    assert other.store.drain(30) and victim.read_bytes() != bytes(data)  # removed, then written whole again
    # a file of another model (same key, another compatibility string) is refused the same way
    foreign = SharedKvStore(f"file://{store.backend.path}", "model=other")
    foreign.pool = other.kv_pool
    key_file = sorted(store.backend.path.glob("*/*.kvb"))[0]
    key = int(key_file.stem, 16)
    assert foreign._read_all([(key, 0, [])]) is None and foreign.stats.corrupt_blocks == 1


def test_a_slow_or_vanished_store_costs_a_recompute_not_a_hang(make, monkeypatch):
    tokens, store = computed(make())
    other = make()
    read = SharedKvStore._read_all

    def slow(self, wanted):
        time.sleep(0.5)
        return read(self, wanted)

    monkeypatch.setattr(kv_shared_store, "READ_TIMEOUT_S", 0.05)
    monkeypatch.setattr(SharedKvStore, "_read_all", slow)
    again, _ = serve(other, "slow")
    assert again == tokens and other.store.stats.restore_failures == 1 and other.store.stats.restored_blocks == 0
    assert other.store.stats.timeouts == 1
    # skipped now: had the next admission asked the store, its slow read would have timed out again
    assert serve(other, "skipped")[0] == tokens and other.store.stats.timeouts == 1
    monkeypatch.setattr(SharedKvStore, "_read_all", read)
    monkeypatch.setattr(kv_shared_store, "READ_TIMEOUT_S", 5.0)
    assert other.store.drain(30)
    shutil.rmtree(store.backend.path)  # the volume went away
    third = make(store=f"file://{store.backend.path}")  # recreated empty at start
    assert serve(third, "gone")[0] == tokens and third.store.stats.restored_blocks == 0
    assert third.store.drain(30)
    shutil.rmtree(store.backend.path)  # and away again while serving: writes fail, counted
    serve(third, "gone-again", prompt=[7 + i for i in range(61)])
    assert third.store.drain(30) and third.store.stats.dropped_blocks > 0


def test_the_store_keeps_to_its_max(make, monkeypatch, tmp_path):
    monkeypatch.setattr(kv_store_backends, "TRIM_EVERY", 1)
    engine = make(store=f"file://{tmp_path / 'small'}?max=20KiB")
    for i in range(4):
        serve(engine, f"r{i}", prompt=[300 + 70 * i + j for j in range(61)])
        engine.store.drain(30)
    block_bytes = engine.kv_pool.block_bytes * engine.kv_pool.num_layers
    total = sum(p.stat().st_size for p in (tmp_path / "small").glob("*/*.kvb"))
    assert engine.store.stats.evicted_blocks > 0 and total <= 20 * 1024 + block_bytes


@pytest.mark.parametrize(
    "url,message",
    [
        ("s3://bucket/kv", "file:///PATH or mooncake://"),
        ("file://host/kv", "ABSOLUTE"),
        ("file:///tmp/kv?size=1G", "unknown option"),
        ("file:///tmp/kv?max=lots", "max"),
        ("mooncake:///kv", "MASTER_HOST:PORT"),
        ("mooncake://m:50051?max=1GiB", "unknown option"),
        ("mooncake://m:50051?segment=lots", "segment"),
    ],
)
def test_a_bad_store_url_is_refused_naming_the_flag(url, message, tiny_model_dir):
    with pytest.raises(ValueError, match="--kv-store.*" + message):
        EngineConfig(model_dir=tiny_model_dir, kv_store=url)


def test_an_unwritable_store_is_refused_at_start(make, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="--kv-store.*not a writable directory"):
        make(store=f"file://{blocker}/kv")


def test_a_node_with_a_store_exports_its_series(tiny_model_dir, tmp_path):
    from pdserve.node_runtime.node import NodeRuntime
    from pdserve.node_runtime.node_config import NodeConfig

    config = EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=32, kv_store=f"file://{tmp_path}")
    rt = NodeRuntime("decode", NodeConfig(config))
    try:
        labels = {"role": "decode", "model_name": rt.metrics.model_name}
        for op in ("stored", "restored", "evicted", "dropped", "corrupt"):
            assert rt.metrics.registry.get_sample_value("pdserve_kv_store_blocks_total", {**labels, "op": op}) == 0
    finally:
        rt.engine.close()


def test_a_mooncake_store_without_the_mooncake_package_is_refused_naming_it(make, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as if the wheel were not installed
    with pytest.raises(ValueError, match="--kv-store mooncake://.*mooncake-transfer-engine"):
        make(store="mooncake://127.0.0.1:50051")


EXIT_SCRIPT = """
import atexit, sys
from pdserve.engine import kv_mooncake
atexit.register(lambda: sys.stdout.write("exit handlers ran"))  # unflushed: exit_process flushes it
print("returned", kv_mooncake.exit_process(5), flush=True)
kv_mooncake._opened = True  # as after a client's setup
kv_mooncake.exit_process(3)
print("not reached")
"""


def test_a_process_that_opened_a_mooncake_client_exits_with_its_own_code_after_its_exit_handlers():
    """Mooncake 0.3.13's C++ teardown can abort a process whose master died: such a process leaves by
    os._exit, after Python's exit handlers, with the status it chose; any other returns the code."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == ["returned 5", "exit handlers ran"]
