"""Scheduler and engine lifecycle on the tiny model (small pools force the interesting paths)."""

from __future__ import annotations

import pytest

from pdserve.engine import AdmissionError, EngineConfig, LLMEngine, RequestStatus, SamplingParams
from pdserve.engine.remote_prefill import RemotePrefillPolicy
from tests.engine.factories import add_remote

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def make_engine(tiny_model_dir):
    engines = []

    def make(**kw) -> LLMEngine:
        kw.setdefault("num_kv_blocks", 64)
        kw.setdefault("block_size", 4)
        engine = LLMEngine(EngineConfig(model_dir=tiny_model_dir, **kw), connector=RemotePrefillPolicy())
        engines.append(engine)
        return engine

    yield make
    for e in engines:  # every test ends with all blocks free and consistent
        assert not e.has_unfinished_requests()
        e.check_integrity()
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def run_all(engine: LLMEngine, limit: int = 500) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def test_token_budget_chunks_long_prompts(make_engine):
    engine = make_engine(max_num_batched_tokens=16)
    sizes: list[tuple[int, list[bool]]] = []
    real_run = engine.runner.run

    def spy(batch, **kw):
        sizes.append((batch.num_tokens, batch.sample_mask))
        return real_run(batch, **kw)

    engine.runner.run = spy
    engine.add_request("long", list(range(5, 45)), GREEDY)
    run_all(engine)
    # a 40-token prompt in chunks of 16, 16, 8 (only the last samples), then 1-token decodes
    assert sizes[:4] == [(16, [False]), (16, [False]), (8, [True]), (1, [True])]
    assert len(sizes) == 3 + GREEDY.max_tokens - 1


def test_chunked_equals_unchunked(make_engine):
    prompt = list(range(7, 60))
    a = make_engine(max_num_batched_tokens=8)
    b = make_engine(max_num_batched_tokens=512)
    a.add_request("r", prompt, GREEDY)
    b.add_request("r", prompt, GREEDY)
    assert run_all(a) == run_all(b)


def test_max_num_seqs_limits_running(make_engine):
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(f"r{i}", [10 + i, 11, 12], GREEDY)
    engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 3
    run_all(engine)


def test_recompute_preemption_gives_same_tokens(make_engine):
    prompts = {f"r{i}": [20 + i] * 6 for i in range(4)}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    small = make_engine(num_kv_blocks=12, enable_prefix_caching=False)
    big = make_engine(num_kv_blocks=64)
    for rid, p in prompts.items():
        small.add_request(rid, p, params)
        big.add_request(rid, p, params)
    preempted = False
    out_small: dict[str, list[int]] = {}
    while small.has_unfinished_requests():
        for o in small.step():
            out_small.setdefault(o.request_id, []).extend(o.new_token_ids)
        preempted |= any(r.status == RequestStatus.PREEMPTED for r in small.scheduler.waiting)
    assert preempted, "pool was meant to be too small for all four requests"
    assert small.scheduler.num_preemptions >= 1 and big.scheduler.num_preemptions == 0  # vllm:num_preemptions
    assert out_small == run_all(big)


def test_never_preempt_reserves_and_refuses(make_engine):
    engine = make_engine(num_kv_blocks=10, preemption="never")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", [5] * 8, params)  # needs 5 blocks over its life
    engine.add_request("b", [6] * 8, params)  # another 5
    engine.add_request("c", [7] * 8, params)  # must wait: admitting it could force a preemption later
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a", "b"]
    with pytest.raises(AdmissionError):
        add_remote(engine, "d", [8] * 8, params)
    run_all(engine)


def test_remote_prefill_flow(make_engine, tiny_model_dir):
    ref = make_engine()
    ref.add_request("x", [9, 10, 11, 12, 13], GREEDY)
    expected = run_all(ref)["x"]
    # "prefill node": compute the prompt only and hold the blocks
    pre = make_engine()
    pre.add_request("x", [9, 10, 11, 12, 13], GREEDY, prefill_only=True)
    out = pre.step()
    assert out[0].new_token_ids == expected[:1] and out[0].finished
    held = pre.requests["x"].block_ids  # parked: finished, pinned until release
    # "decode node": allocate, receive the KV (copied here by hand), complete
    dec = make_engine()
    blocks = add_remote(dec, "x", [9, 10, 11, 12, 13], GREEDY)
    assert dec.requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    for src, dst in zip(held, blocks):
        dec.runner.kv_pool.tensor[:, dst] = pre.runner.kv_pool.tensor[:, src]
    pre.release("x")
    dec.complete_remote_prefill("x", expected[0])
    got = expected[:1] + run_all(dec)["x"]
    assert got == expected


def test_remote_prefill_finishing_on_first_token(make_engine):
    dec = make_engine()
    add_remote(dec, "x", [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=1))
    dec.complete_remote_prefill("x", 42)
    outs = dec.step()
    assert outs[0].finished and outs[0].finish_reason == "length" and outs[0].num_output_tokens == 1


def test_abort_in_every_state(make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.add_request("running", [5, 6, 7], GREEDY)
    engine.add_request("waiting", [5, 6, 8], GREEDY)
    add_remote(engine, "remote", [5, 6, 9], GREEDY)
    engine.add_request("held", [5, 6, 10], GREEDY, prefill_only=True)
    engine.step()
    assert engine.abort("running") and engine.abort("waiting") and engine.abort("remote")
    assert not engine.abort("nope")
    outs = run_all(engine)
    assert engine.requests["held"].status.is_finished and engine.parked() == [engine.requests["held"]]
    assert engine.abort("held") and "held" not in engine.requests
    assert set(outs) >= {"running", "waiting", "remote"}


def test_outputs_report_how_long_a_request_waited_before_it_ran(make_engine):
    """Local requests wait for a slot; a remote-prefill request waits for its KV (vllm:request_queue_time_seconds)."""
    engine = make_engine(max_num_seqs=1)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [4, 5, 6], GREEDY)  # waits until "a" finishes: one slot
    waited = {}
    for _ in range(100):
        for out in engine.step():
            assert out.queue_seconds is not None and out.queue_seconds >= 0
            waited.setdefault(out.request_id, out.queue_seconds)
        if not engine.has_unfinished_requests():
            break
    assert waited["b"] > waited["a"]
    add_remote(engine, "r", [7, 8, 9], GREEDY)
    engine.complete_remote_prefill("r", 10)
    outs = [o for o in engine.step() if o.request_id == "r"]
    assert outs and outs[0].queue_seconds is not None
    run_all(engine)


def test_integrity_check_follows_each_request_status(make_engine):
    """Who holds blocks is answered by status alone: a status that disagrees with the request's place fails."""
    engine = make_engine(max_num_seqs=1)
    engine.add_request("a", [5, 6, 7], GREEDY)
    engine.add_request("b", [5, 6, 8], GREEDY)
    add_remote(engine, "r", [5, 6, 9], GREEDY)
    engine.step()
    engine.check_integrity()
    assert engine.parked() == [engine.requests["r"]]
    engine.requests["b"].status = RequestStatus.WAITING_FOR_REMOTE_KV
    with pytest.raises(AssertionError, match="'b' is WAITING_FOR_REMOTE_KV but waiting"):
        engine.check_integrity()
    engine.requests["b"].status = RequestStatus.WAITING
    with pytest.raises(KeyError, match="not waiting for remote KV"):
        engine.complete_remote_prefill("a", 1)
    assert engine.abort("r")
    run_all(engine)
