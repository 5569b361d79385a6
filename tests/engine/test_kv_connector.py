"""The engine's KV connector seam: when each hook is called, and a new KV source plugged in through it."""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine, RequestStatus, SamplingParams
from pdserve.engine.kv_connector import ExternalKv, KvConnector

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPT = [5 + i for i in range(13)]  # block size 4: 3 full blocks and a partial one


class Recorder(KvConnector):
    """Records every call; supplies the KV of requests marked `external` (asynchronously)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.pool = None
        self.allocated: dict[str, tuple[list[int], int]] = {}

    def match(self, request, pool_tokens):
        self.calls.append(("match", request.request_id, pool_tokens))
        return ExternalKv() if request.kv_transfer_params.get("external") else None

    def after_alloc(self, request, block_ids, held_tokens):
        self.calls.append(("after_alloc", request.request_id))
        self.allocated[request.request_id] = (list(block_ids), held_tokens)

    def request_finished(self, request):
        self.calls.append(("finished", request.request_id, request.status.name))

    def register_kv_pool(self, pool):
        self.calls.append(("register",))
        self.pool = pool

    def start_load(self, batch):
        self.calls.append(("start_load", tuple(batch.request_ids)))

    def wait_for_layer(self, layer):
        self.calls.append(("wait", layer))

    def save_layer(self, layer, batch):
        self.calls.append(("save", layer))

    def wait_for_save(self):
        self.calls.append(("wait_for_save",))


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(100):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            return tokens
    raise AssertionError("engine did not finish")


@pytest.fixture
def make(tiny_model_dir):
    engines: list[LLMEngine] = []

    def build(connector: KvConnector | None = None) -> LLMEngine:
        kwargs = {"connector": connector} if connector is not None else {}
        engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, num_kv_blocks=32, block_size=4), **kwargs)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:  # nothing leaked, whatever the connector did
        assert not engine.has_unfinished_requests()
        engine.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_hooks_run_in_the_documented_order(make):
    rec = Recorder()
    engine = make(rec)
    layers = engine.model_config.num_hidden_layers
    assert rec.calls == [("register",)] and rec.pool is engine.kv_pool
    engine.add_request("a", PROMPT, GREEDY)
    assert rec.calls[-1] == ("match", "a", 0)
    rec.calls.clear()
    engine.step()
    # one step: the load starts, each layer waits for its restore before it is saved, then the save completes
    per_layer = [call for layer in range(layers) for call in (("wait", layer), ("save", layer))]
    assert rec.calls == [("start_load", ("a",)), *per_layer, ("wait_for_save",)]
    _run(engine)
    assert [c for c in rec.calls if c[0] == "finished"] == [("finished", "a", "FINISHED_LENGTH")]
    # a prefix now cached is what `match` is told the pool holds; an abort is not a finish
    rec.calls.clear()
    engine.add_request("b", PROMPT, GREEDY)
    assert rec.calls == [("match", "b", 12)]
    engine.abort("b")
    _run(engine)
    assert not [c for c in rec.calls if c[0] == "finished"]


def test_a_new_kv_source_plugs_in_without_the_scheduler_knowing(make):
    """A connector that supplies whole prompts (here copied from another engine's pool, as a KV tier
    or a new transport would) gives the text the engine computes itself."""
    ref = make()
    ref.add_request("x", PROMPT, GREEDY)
    expected = _run(ref)["x"]
    source = make()  # computes the prompt only and keeps its blocks, as a prefill node does
    source.add_request("x", PROMPT, GREEDY, prefill_only=True)
    first = source.step()[0].new_token_ids[0]
    rec = Recorder()
    engine = make(rec)
    where = engine.add_request("x", PROMPT, GREEDY, kv_transfer_params={"external": True})
    assert where.location == "remote" and engine.requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    blocks, held = rec.allocated["x"]
    assert (blocks, held) == (where.block_ids, 0)
    assert engine.step() == []  # parked: the scheduler neither runs nor frees it
    for src, dst in zip(source.requests["x"].block_ids, blocks):
        rec.pool.tensor[:, dst] = source.kv_pool.tensor[:, src]
    source.release("x")
    engine.complete_remote_prefill("x", first)
    assert [first] + _run(engine)["x"] == expected


def test_a_failed_source_falls_back_to_computing_here(make):
    rec = Recorder()
    engine = make(rec)
    engine.add_request("ref", PROMPT, GREEDY)
    expected = _run(engine)["ref"]
    where = engine.add_request("x", PROMPT, GREEDY, kv_transfer_params={"external": True})
    assert where.held_tokens == 12 and rec.allocated["x"][0][:3] == where.block_ids[:3]  # the cached prefix, shared
    engine.prefill_locally("x")
    assert _run(engine)["x"] == expected
    with pytest.raises(KeyError, match="not waiting for remote KV"):
        engine.complete_remote_prefill("x", 1)
