"""Where should a decode node prefill a prompt whose prefix it already holds? Local vs remote, and
D->P pull vs recompute: the measurements behind `--local-prefill-max-tokens` and issue 22's choice.

One prefill and one decode node process (tcp CacheStore, one torch thread each). Both hold a
1000-token prefix (warmed by one remote request); then follow-ups of prefix + N new tokens, each
N both ways, interleaved so both see the same machine load: `local` (no prefill address: the
decode node computes the N tokens itself) and `remote` (the prefill node computes them and the
missing blocks cross the CacheStore). TTFT = first token at the client, median of the repetitions.
The threshold is the largest N (of the sweep) up to which local is never slower than remote
(+ `--margin`). Then, for the D->P question: recompute cost per block (the local TTFT's slope over
N) against a CacheStore transfer of one block of this model (all layers) between two processes.

    python -m benchmarks.local_prefill [--quick] [--model-size bench|tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from benchmarks.cluster_procs import NodeProc
from benchmarks.common import emit

SECRET = "bench"
PREFIX = [10 + (i * 7919) % 1500 for i in range(1000)]
BLOCK = 16


async def ttft(decode: str, rid: str, prompt: list[int], prefill: list[str]) -> float:
    import grpc

    from pdserve.node_runtime.auth import cluster_metadata
    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    req = decode_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        params=common_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        prefill_addresses=prefill,
    )
    async with grpc.aio.insecure_channel(decode) as ch:
        start = time.perf_counter()
        async for event in decode_pb2_grpc.DecodeStub(ch).Generate(req, metadata=cluster_metadata(SECRET), timeout=600):
            if event.token_ids:
                return time.perf_counter() - start
    raise RuntimeError(f"{rid}: no token")


async def sweep(decode: str, prefill: str, sizes: list[int], reps: int) -> dict[int, dict[str, float]]:
    """Median TTFT (s) per N new tokens, local and remote."""
    await ttft(decode, "warm", PREFIX + [3], [prefill])  # both nodes now hold the prefix
    out: dict[int, dict[str, list[float]]] = {n: {"local": [], "remote": []} for n in sizes}
    k = 0
    for rep in range(reps):
        for n in sizes:
            for mode, addresses in (
                (("local", []), ("remote", [prefill])) if rep % 2 else (("remote", [prefill]), ("local", []))
            ):
                k += 1  # fresh tokens every time: only the prefix is ever cached
                tail = [20 + (k * 131 + j * 17) % 1400 for j in range(n)]
                out[n][mode].append(await ttft(decode, f"{mode}-{n}-{rep}", PREFIX + tail, addresses))
    return {n: {m: statistics.median(v) for m, v in modes.items()} for n, modes in out.items()}


def threshold(medians: dict[int, dict[str, float]], margin: float) -> int:
    """The largest N up to which local was never slower than remote x (1 + margin); 0 if none."""
    best = 0
    for n in sorted(medians):
        if medians[n]["local"] > medians[n]["remote"] * (1 + margin):
            break
        best = n
    return best


def recompute_ms_per_block(medians: dict[int, dict[str, float]]) -> float:
    """Least-squares slope of the local TTFT over N, times a block."""
    xs, ys = list(medians), [medians[n]["local"] for n in medians]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope * BLOCK * 1e3


def transfer_ms_per_block(model: str, rounds: int) -> tuple[float, float]:
    """CacheStore tcp between two processes, this model's fp32 block over all layers: p50 of one
    block alone (ms), and per block of a 64-block transfer (ms)."""
    import torch

    from benchmarks.cachestore_tcp import cachestore_run
    from pdserve.cachestore import PoolGeometry
    from pdserve.engine.kv_pool import kv_bytes_per_token
    from pdserve.engine.model_config import ModelConfig

    config = ModelConfig.from_dir(model)
    geo = PoolGeometry(config.num_hidden_layers, 64, kv_bytes_per_token(config, 1, torch.float32) * BLOCK)
    best_gbps, small = asyncio.run(cachestore_run(geo, rounds, rounds * 10))
    per_block_bulk = geo.block_bytes * geo.num_layers / (best_gbps * 1e9) * 1e3
    return statistics.median(small) * 1e3, per_block_bulk


def main() -> None:
    from pdserve.engine.builtin import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 sizes x 3 repetitions")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    parser.add_argument("--margin", type=float, default=0.1, help="local may be this much slower (fraction)")
    args = parser.parse_args()
    model = str(default_model_dir(args.model_size))
    sizes, reps = ([16, 64, 128], 3) if args.quick else ([8, 16, 32, 64, 128, 256], 5)
    common = ["--port", "0", "--model", model, "--cluster-secret", SECRET, "--num-threads", "1"]
    prefill = NodeProc("prefill", common)
    try:
        decode = NodeProc("decode", common + ["--local-prefill-max-tokens", "0"])
        try:
            medians = asyncio.run(sweep(decode.address, prefill.address, sizes, reps))
        finally:
            decode.stop()
    finally:
        prefill.stop()
    for n, m in sorted(medians.items()):
        print(f"N={n:>4}: local {m['local'] * 1e3:7.1f} ms, remote {m['remote'] * 1e3:7.1f} ms", flush=True)
    chosen = threshold(medians, args.margin)
    recompute = recompute_ms_per_block(medians)
    small, bulk = transfer_ms_per_block(model, 3 if args.quick else 8)
    print(f"per block: recompute {recompute:.1f} ms; CacheStore 1 block {small:.2f} ms, in bulk {bulk:.3f} ms")
    emit(
        {
            "metric": "local_prefill_max_tokens",
            "value": chosen,
            "target": f"largest N with local TTFT <= remote x {1 + args.margin}",
            "local_ttft_ms": {n: round(m["local"] * 1e3, 1) for n, m in sorted(medians.items())},
            "remote_ttft_ms": {n: round(m["remote"] * 1e3, 1) for n, m in sorted(medians.items())},
            "recompute_ms_per_block": round(recompute, 2),
            "transfer_ms_one_block": round(small, 3),
            "transfer_ms_per_block_bulk": round(bulk, 4),
            "model": args.model_size,
        }
    )


if __name__ == "__main__":
    main()
