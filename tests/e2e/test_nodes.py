"""One prefill + two decode node processes on 127.0.0.1: equivalence with pdserve.engine.LLM, edge cases, leaks."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from tests.e2e.cluster import start_cluster
from tests.e2e.deadlines import until
from tests.e2e.grpc_client import generate, greedy, load

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    c = start_cluster(1, 2, model=str(tiny_model_dir))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return LLM(tiny_model_dir, num_kv_blocks=1024)


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 1700) for _ in range(40)]
    prompts = []
    for i in range(n):
        body = [rng.randrange(5, 1700) for _ in range(rng.randrange(2, 120))]
        prompts.append(shared + body if i % 3 == 0 else body)  # a third share a prefix: prefill cache hits
    return prompts


async def all_free(cluster, nominal: float = 0.0) -> None:
    """Every node reports all blocks free (polled up to `nominal` seconds scaled to the machine's load)."""
    busy: list = []

    async def free() -> bool:
        reports = [(p.role, await load(p.address, cluster.secret, p.role)) for p in cluster.all()]
        busy[:] = [(role, r) for role, r in reports if r.num_free_blocks != r.num_total_blocks]
        return not busy

    await until(free, nominal)
    assert not busy, busy


@pytest.mark.parametrize("round_", [0, 1])  # round 1 repeats the prompts: prefill prefix-cache hits
async def test_concurrent_greedy_equals_llm(cluster, reference, round_):
    prompts = mixed_prompts(16, seed=5)
    expected = reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    prefill = [cluster.prefills[0].address]
    results = await asyncio.gather(
        *[
            generate(
                cluster.decodes[i % 2].address,
                cluster.secret,
                f"r{round_}-{i}",
                p,
                greedy(24, ignore_eos=True),
                prefill,
            )
            for i, p in enumerate(prompts)
        ]
    )
    for (tokens, events), exp in zip(results, expected):
        assert tokens == exp.outputs[0].token_ids
        last = events[-1]
        assert last.finish_reason == "length" and last.usage.completion_tokens == 24
        assert last.usage.prompt_tokens == len(exp.prompt_token_ids)
    await all_free(cluster)


async def test_first_token_stop_finishes_with_one_token(cluster, reference):
    prompt = [11, 12, 13, 14]
    first = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0].token_ids[0]
    tokens, events = await generate(
        cluster.decodes[0].address,
        cluster.secret,
        "stop-id",
        prompt,
        greedy(10, stop_token_ids=[first]),
        [cluster.prefills[0].address],
    )
    assert tokens == [first] and events[-1].finish_reason == "stop" and events[-1].usage.completion_tokens == 1
    text = reference.tokenizer.decode([first])
    if text.strip():
        tokens, events = await generate(
            cluster.decodes[1].address,
            cluster.secret,
            "stop-str",
            prompt,
            greedy(10, stop=[text.strip()[:1]]),
            [cluster.prefills[0].address],
        )
        assert tokens == [first] and events[-1].finish_reason == "stop"
    await all_free(cluster)


@pytest.mark.parametrize(
    "mutate,code",
    [
        (lambda r: r.prompt_token_ids.extend([5] * 5000), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r.params, "temperature", -1.0), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.prompt_token_ids.append(10**6), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: setattr(r, "request_id", "bad id!"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda r: r.params.stop.extend(["x"] * 40), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_bad_input_gets_clear_status(cluster, mutate, code):
    from pdserve.node_runtime.auth import cluster_metadata
    from pdserve.v1 import decode_pb2, decode_pb2_grpc

    req = decode_pb2.GenerateRequest(
        request_id="bad", prompt_token_ids=[5, 6, 7], params=greedy(4), prefill_addresses=[cluster.prefills[0].address]
    )
    mutate(req)
    async with grpc.aio.insecure_channel(cluster.decodes[0].address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in decode_pb2_grpc.DecodeStub(ch).Generate(
                req, metadata=cluster_metadata(cluster.secret), timeout=30
            ):
                pass
    assert err.value.code() == code, err.value.details()
    tokens, _ = await generate(
        cluster.decodes[0].address, cluster.secret, "after-bad", [5, 6, 7], greedy(3), [cluster.prefills[0].address]
    )
    assert len(tokens) == 3


async def test_wrong_secret_and_oversized_message_are_refused(cluster):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(
            cluster.decodes[0].address, "wrong", "nosecret", [5, 6], greedy(2), [cluster.prefills[0].address]
        )
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(
            cluster.decodes[0].address,
            cluster.secret,
            "huge",
            [1000] * 3_000_000,
            greedy(2),
            [cluster.prefills[0].address],
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await all_free(cluster)


async def test_incompatible_peer_is_refused(cluster):
    from pdserve.node_runtime.auth import cluster_metadata

    async with grpc.aio.insecure_channel(cluster.prefills[0].address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await prefill_pb2_grpc.PrefillStub(ch).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="x",
                    prompt_token_ids=[5, 6],
                    params=greedy(2),
                    kv_destination=b"{}",
                    compatibility="model=other",
                ),
                metadata=cluster_metadata(cluster.secret),
                timeout=10,
            )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incompatible" in err.value.details()


async def test_abort_during_decode_frees_blocks(cluster):
    from pdserve.node_runtime.auth import cluster_metadata
    from pdserve.v1 import decode_pb2, decode_pb2_grpc

    async with grpc.aio.insecure_channel(cluster.decodes[0].address) as ch:
        call = decode_pb2_grpc.DecodeStub(ch).Generate(
            decode_pb2.GenerateRequest(
                request_id="abort-me",
                prompt_token_ids=list(range(5, 60)),
                params=greedy(2000, ignore_eos=True),
                prefill_addresses=[cluster.prefills[0].address],
            ),
            metadata=cluster_metadata(cluster.secret),
        )
        seen = 0
        async for event in call:
            seen += len(event.token_ids)
            if seen >= 3:
                call.cancel()
                break
    await all_free(cluster, nominal=1.0)  # the bound: blocks free within a second of the cancel (idle machine)


async def test_abort_during_prefill_frees_blocks(cluster):
    """A cancel while the prefill node computes a long prompt frees every block on both nodes: the
    prefill node's abort runs at its next chunk boundary (the engine's step), not after the prompt."""
    from pdserve.node_runtime.auth import cluster_metadata
    from pdserve.v1 import decode_pb2, decode_pb2_grpc

    prefill = cluster.prefills[0]

    async def prefill_busy() -> bool:
        try:
            r = await load(prefill.address, cluster.secret, "prefill", timeout=0.5)
        except grpc.aio.AioRpcError as e:  # load waits for the engine's step: no answer = mid-step
            return e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return r.num_free_blocks < r.num_total_blocks

    async with grpc.aio.insecure_channel(cluster.decodes[1].address) as ch:
        call = decode_pb2_grpc.DecodeStub(ch).Generate(
            decode_pb2.GenerateRequest(
                request_id="abort-early",
                prompt_token_ids=[5 + i % 1000 for i in range(3000)],
                params=greedy(4),
                prefill_addresses=[prefill.address],
            ),
            metadata=cluster_metadata(cluster.secret),
        )
        reader = asyncio.ensure_future(call.read())
        await until(prefill_busy, nominal=2.0, interval=0.01)  # cancel mid-prefill when we catch it there
        call.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    await all_free(cluster, nominal=2.0)
