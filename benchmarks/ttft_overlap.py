"""How much of the KV transfer is hidden behind prefill compute (layer-wise streaming).

For prompts of 512 and 2048 tokens on the `bench` model over the tcp transport:
  * prefill compute alone (the prefill engine, no transfer);
  * the transfer alone (CacheStore tcp, same layers x blocks, two processes);
  * disaggregated TTFT (decode node -> prefill node -> KV -> first token, real processes);
  * exposed fraction = (TTFT - compute alone) / transfer alone, clipped at 0.
Target: at most 25% exposed for the 2048-token prompt.

    python benchmarks/ttft_overlap.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cachestore_tcp import cachestore_run  # noqa: E402
from benchmarks.cluster_procs import NodeProc  # noqa: E402
from benchmarks.common import emit  # noqa: E402
from cachestore import PoolGeometry  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.builtin import default_model_dir  # noqa: E402

SECRET = "bench"


def compute_alone(model_dir: Path, prompt: list[int], threads: int, reps: int) -> tuple[float, PoolGeometry]:
    engine = LLMEngine(EngineConfig(model_dir, num_threads=threads, max_num_batched_tokens=8192,
                                    enable_prefix_caching=False, num_kv_blocks=len(prompt) // 16 + 8))
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        engine.add_request(f"c{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1), prefill_only=True)
        engine.step()
        times.append(time.perf_counter() - start)
        engine.release(f"c{i}")
    pool = engine.runner.kv_pool
    blocks = (len(prompt) + pool.block_size - 1) // pool.block_size
    return statistics.median(times[1:]), PoolGeometry(pool.num_layers, blocks, pool.block_bytes)


async def ttft(decode: str, prefill: str, prompt: list[int], reps: int) -> float:
    import grpc

    from pdserve.runtime.auth import cluster_metadata
    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
    times = []
    async with grpc.aio.insecure_channel(decode) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        for i in range(reps + 1):
            req = decode_pb2.GenerateRequest(
                request_id=f"t{len(prompt)}-{i}", prompt_token_ids=[t + i for t in prompt],  # no prefix-cache hits
                params=common_pb2.SamplingParams(temperature=0.0, max_tokens=1), prefill_addresses=[prefill])
            start = time.perf_counter()
            async for _ in stub.Generate(req, metadata=cluster_metadata(SECRET), timeout=300):
                times.append(time.perf_counter() - start)
                break
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and a shorter long prompt")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the prefill engine (both runs)")
    args = parser.parse_args()
    model = default_model_dir("bench")
    lengths, reps = ([512, 1024], 2) if args.quick else ([512, 2048], 3)
    node_args = ["--port", "0", "--model", str(model), "--cluster-secret", SECRET, "--transport", "tcp"]
    prefill = NodeProc("prefill", node_args + ["--num-threads", str(args.threads)])
    try:
        decode = NodeProc("decode", node_args + ["--num-threads", "1"])
        try:
            rows = {}
            for n in lengths:
                prompt = [10 + (i * 7919) % 1500 for i in range(n)]
                compute, geo = compute_alone(model, prompt, args.threads, reps)
                transfer, _ = asyncio.run(cachestore_run(geo, reps, 1))
                transfer_s = geo.total_bytes / (transfer * 1e9)
                t = asyncio.run(ttft(decode.address, prefill.address, prompt, reps))
                exposed = max(0.0, t - compute) / transfer_s
                rows[n] = {"compute_s": round(compute, 4), "transfer_s": round(transfer_s, 4),
                           "ttft_s": round(t, 4), "kv_mib": round(geo.total_bytes / 2**20, 1),
                           "exposed_fraction": round(exposed, 3)}
                print(f"prompt {n}: compute {compute * 1e3:.0f} ms, transfer alone {transfer_s * 1e3:.1f} ms "
                      f"({rows[n]['kv_mib']} MiB), disaggregated TTFT {t * 1e3:.0f} ms, exposed {exposed:.0%}")
        finally:
            decode.stop()
    finally:
        prefill.stop()
    long = rows[lengths[-1]]
    emit({"metric": f"exposed_transfer_fraction_{lengths[-1]}", "value": long["exposed_fraction"],
          "baseline": 1.0, "ratio": long["exposed_fraction"], "target": 0.25, "threads": args.threads,
          "rows": rows})


if __name__ == "__main__":
    main()
