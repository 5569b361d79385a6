"""Serving benchmark against a local cluster: router + 1 prefill + 2 decode processes.

At three Poisson request rates it measures request throughput, output tokens/s,
TTFT and inter-token latency percentiles (streaming /v1/completions; one run per
rate, a description of the cluster, not a comparison), then the router's added
latency at concurrency 32: the same requests through the router versus straight
to a decode node over gRPC. Those two arms alternate over `--rounds` rounds (the
order reverses every round); the medians and the median of the paired per-round
ratios are reported, every round's wall times in the JSON.

    python -m benchmarks.serve [--quick] [--model-size bench|tiny] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import time

import httpx

from benchmarks.cluster_procs import NodeProc
from benchmarks.common import Rounds, alternate, emit, node_bench_args, pct

SECRET = "bench"


async def one_stream(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
) -> tuple[float, list[float], int]:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, last, gaps, tokens = None, None, [], 0
    async with client.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if ttft is None:
                    ttft = now - start
                elif last is not None:
                    gaps.append(now - last)
                last = now
    return ttft or 0.0, gaps, tokens


async def at_rate(url: str, rate: float, n: int, max_tokens: int, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        tasks, start = [], time.perf_counter()
        for i in range(n):
            words = " ".join(
                rng.choice(["river", "lighthouse", "keeper", "bread", "village", "storm"])
                for _ in range(rng.randint(8, 120))
            )
            tasks.append(asyncio.create_task(one_stream(client, url, f"{i}: {words}", max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    return {
        "rate": rate,
        "req_per_s": round(n / elapsed, 3),
        "output_tok_per_s": round(tokens / elapsed, 1),
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1e3, 1),
        "ttft_p99_ms": round(pct(ttfts, 0.99) * 1e3, 1),
        "itl_p50_ms": round(pct(gaps, 0.5) * 1e3, 1),
        "itl_p99_ms": round(pct(gaps, 0.99) * 1e3, 1),
    }


def router_overhead(url: str, decode: str, prefill: str, tokenizer, concurrency: int, rounds: int) -> Rounds:
    """Wall seconds of `concurrency` requests at once, through the router (`router`) and straight to a
    decode node (`direct`), alternated over `rounds` after one warm-up of each."""
    import grpc

    from pdserve.node_runtime.auth import cluster_metadata
    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    prompts = [f"request {i} about the old lighthouse" for i in range(concurrency)]

    async def via_router() -> float:
        async with httpx.AsyncClient() as client:
            start = time.perf_counter()
            await asyncio.gather(
                *[
                    client.post(
                        url,
                        timeout=300,
                        json={"model": "bench", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                    )
                    for p in prompts
                ]
            )
            return time.perf_counter() - start

    async def direct() -> float:
        async with grpc.aio.insecure_channel(decode) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)

            async def one(i: int, p: str) -> None:
                req = decode_pb2.GenerateRequest(
                    request_id=f"d{i}-{time.monotonic_ns()}",
                    prompt_token_ids=tokenizer.encode(p),
                    params=common_pb2.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                    prefill_addresses=[prefill],
                )
                async for _ in stub.Generate(req, metadata=cluster_metadata(SECRET), timeout=300):
                    pass

            start = time.perf_counter()
            await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
            return time.perf_counter() - start

    asyncio.run(via_router())  # warm up both paths
    asyncio.run(direct())
    return alternate(
        {
            "router": lambda: {"seconds": round(asyncio.run(via_router()), 4)},
            "direct": lambda: {"seconds": round(asyncio.run(direct()), 4)},
        },
        rounds,
    )


def main() -> None:
    args, model, common = node_bench_args(__doc__.splitlines()[0], SECRET, rounds=True)
    n, max_tokens, rates = (12, 16, [0.5, 1.0, 2.0]) if args.quick else (40, 64, [0.25, 0.5, 1.0])
    procs = []
    try:
        procs.append(NodeProc("prefill", common))
        procs += [NodeProc("decode", common), NodeProc("decode", common)]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(
            NodeProc(
                "router",
                [
                    "--port",
                    str(port),
                    "--model",
                    model,
                    "--served-model-name",
                    "bench",
                    "--cluster-secret",
                    SECRET,
                    "--prefill",
                    procs[0].address,
                    "--decode",
                    f"{procs[1].address},{procs[2].address}",
                ],
            )
        )
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        rows = [asyncio.run(at_rate(f"{base}/v1/completions", r, n, max_tokens, seed=i)) for i, r in enumerate(rates)]
        for row in rows:
            print(json.dumps(row))
        from pdserve.engine.tokenizer import Tokenizer

        runs = router_overhead(
            f"{base}/v1/completions", procs[1].address, procs[0].address, Tokenizer(model), 32, args.rounds
        )
    finally:
        for p in reversed(procs):
            p.stop()
    r = statistics.median(f["seconds"] for f in runs.of("router"))
    d = statistics.median(f["seconds"] for f in runs.of("direct"))
    print(f"router vs direct at concurrency 32 (medians of {args.rounds} rounds): {r * 1e3:.0f} ms vs {d * 1e3:.0f} ms")
    emit(
        {
            "metric": "router_latency_ratio_c32",
            "value": round(r, 4),
            "baseline": round(d, 4),
            "ratio": runs.median_ratio("router", "direct", "seconds"),
            "ratio_is": "median of the paired per-round ratios",
            "target": "<= 1.10",
            "router_added_ms": round((r - d) * 1e3, 1),
            "model": args.model_size,
            "rounds": runs.rounds,
            "rates": rows,
        }
    )


if __name__ == "__main__":
    main()
