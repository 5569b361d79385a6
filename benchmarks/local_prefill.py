"""Where should a decode node prefill a prompt whose prefix it already holds? Local vs remote, and
D->P pull vs recompute: the measurements behind `--local-prefill-max-tokens` and issue 22's choice.

One prefill and one decode node process (tcp CacheStore, one torch thread each). Both hold a
1000-token prefix (warmed by one remote request); then follow-ups of prefix + N new tokens, each
N both ways in each of `--rounds` rounds (which goes first reverses every round), so both see the
same machine load: `local` (no prefill address: the decode node computes the N tokens itself) and
`remote` (the prefill node computes them and the missing blocks cross the CacheStore). TTFT = first
token at the client, median over the rounds; every round's TTFTs are in the JSON.
The threshold is the largest N (of the sweep) up to which local is never slower than remote
(+ `--margin`). Then, for the D->P question: recompute cost per block (the local TTFT's slope over
N) against a CacheStore transfer of one block of this model (all layers) between two processes.

    python -m benchmarks.local_prefill [--quick] [--model-size bench|tiny] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from collections.abc import Awaitable, Callable

from benchmarks.cluster_procs import NodeProc
from benchmarks.common import Rounds, add_rounds_arg, arm_order, emit, median_figures

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


async def paired_sweep(
    sizes: list[int], rounds: int, modes: tuple[str, str], measure: Callable[[str, int, int], Awaitable[float]]
) -> Rounds:
    """`measure(mode, size, round)` (seconds) for every size and both modes, in `rounds` rounds; within
    a round each size runs both modes back to back, the first reversing every round (`arm_order`).
    Per round: {mode: {str(size): seconds}}, so `Rounds.median_ratio(a, b, str(size))` pairs them."""
    per_round: list[dict[str, dict]] = []
    for r in range(rounds):
        got: dict[str, dict] = {m: {} for m in modes}
        for n in sizes:
            for mode in arm_order(list(modes), r):
                got[mode][str(n)] = await measure(mode, n, r)
        per_round.append(got)
        print(f"round {r} of {rounds} done", flush=True)
    return Rounds(per_round, {})


def sweep_medians(runs: Rounds) -> dict[int, dict[str, float]]:
    """size -> mode -> median seconds over the rounds."""
    by_mode = {mode: median_figures(runs.of(mode)) for mode in runs.rounds[0]}
    return {int(n): {mode: figures[n] for mode, figures in by_mode.items()} for n in next(iter(by_mode.values()))}


def sweep_json(runs: Rounds, modes: tuple[str, str]) -> dict:
    """The JSON of a paired sweep: per mode the median TTFT (ms) per size, per size the median of the
    paired per-round ratios modes[0] / modes[1], and every round's TTFTs (ms)."""
    medians = sweep_medians(runs)
    first, second = modes
    return {
        f"{first}_ttft_ms": {n: round(m[first] * 1e3, 1) for n, m in sorted(medians.items())},
        f"{second}_ttft_ms": {n: round(m[second] * 1e3, 1) for n, m in sorted(medians.items())},
        f"{first}_over_{second}": {n: runs.median_ratio(first, second, str(n)) for n in sorted(medians)},
        "rounds_ttft_ms": [
            {mode: {n: round(t * 1e3, 1) for n, t in by_size.items()} for mode, by_size in r.items()}
            for r in runs.rounds
        ],
    }


async def sweep(decode: str, prefill: str, sizes: list[int], rounds: int) -> Rounds:
    """TTFT (s) per N new tokens, local and remote, per round."""
    await ttft(decode, "warm", PREFIX + [3], [prefill])  # both nodes now hold the prefix
    k = 0

    async def measure(mode: str, n: int, r: int) -> float:
        nonlocal k
        k += 1  # fresh tokens every time: only the prefix is ever cached
        tail = [20 + (k * 131 + j * 17) % 1400 for j in range(n)]
        return await ttft(decode, f"{mode}-{n}-{r}", PREFIX + tail, [prefill] if mode == "remote" else [])

    return await paired_sweep(sizes, rounds, ("local", "remote"), measure)


def threshold(local_over_remote: dict[int, float | None], margin: float) -> int:
    """The largest N up to which local was never slower than remote x (1 + margin), by the median of
    the paired per-round ratios; 0 if none."""
    best = 0
    for n in sorted(local_over_remote):
        ratio = local_over_remote[n]
        if ratio is None or ratio > 1 + margin:
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
    from pdserve.node_runtime.node_config import DEFAULT_LOCAL_PREFILL_MAX_TOKENS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 sizes instead of 6")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    parser.add_argument("--margin", type=float, default=0.1, help="local may be this much slower (fraction)")
    add_rounds_arg(parser, default=5)
    args = parser.parse_args()
    model = str(default_model_dir(args.model_size))
    sizes = [16, 64, 128] if args.quick else [8, 16, 32, 64, 128, 256]
    common = ["--port", "0", "--model", model, "--cluster-secret", SECRET, "--num-threads", "1"]
    prefill = NodeProc("prefill", common)
    try:
        decode = NodeProc("decode", common + ["--local-prefill-max-tokens", "0"])
        try:
            runs = asyncio.run(sweep(decode.address, prefill.address, sizes, args.rounds))
        finally:
            decode.stop()
    finally:
        prefill.stop()
    medians = sweep_medians(runs)
    for n, m in sorted(medians.items()):
        print(f"N={n:>4}: local {m['local'] * 1e3:7.1f} ms, remote {m['remote'] * 1e3:7.1f} ms", flush=True)
    figures = sweep_json(runs, ("local", "remote"))
    chosen = threshold(figures["local_over_remote"], args.margin)
    recompute = recompute_ms_per_block(medians)
    small, bulk = transfer_ms_per_block(model, 3 if args.quick else 8)
    print(f"per block: recompute {recompute:.1f} ms; CacheStore 1 block {small:.2f} ms, in bulk {bulk:.3f} ms")
    emit(
        {
            "metric": "local_prefill_max_tokens",
            "value": chosen,
            "baseline": DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
            "baseline_is": "the default --local-prefill-max-tokens",
            "ratio": round(chosen / DEFAULT_LOCAL_PREFILL_MAX_TOKENS, 3),
            "target": f"largest N with local TTFT <= remote x {1 + args.margin} (median of the paired ratios)",
            **figures,
            "recompute_ms_per_block": round(recompute, 2),
            "transfer_ms_one_block": round(small, 3),
            "transfer_ms_per_block_bulk": round(bulk, 4),
            "model": args.model_size,
        }
    )


if __name__ == "__main__":
    main()
