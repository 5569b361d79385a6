"""How much of the KV transfer is hidden behind prefill compute (layer-wise streaming).

For prompts of 512 and 2048 tokens on the `bench` model over the tcp transport (or
`--transport rdma`: on a host without an RDMA NIC, the emulated verbs device, EMULATED: its timings
say nothing about a NIC), with a real prefill node process:
  * prefill compute: `prefill_seconds` reported by the prefill node (request start to
    the first token sampled, i.e. all layers computed; its layer hook has been
    streaming each layer's blocks since layer 0 finished);
  * the Prefill RPC time: the node replies only after the receiver acknowledged
    every layer, so exposed transfer = RPC time - prefill compute (includes the
    RPC's own overhead, so it over-states the exposure);
  * the transfer alone: CacheStore (same transport) moving the same layers x blocks
    between two processes, with nothing else running;
  * disaggregated TTFT through a decode node (decode -> prefill -> KV -> first token);
  * exposed fraction = exposed transfer / transfer alone. Target: <= 25% at 2048.
The three measurements alternate over `--rounds` rounds (their order reverses every round, fresh
prompts every time); each figure is the median over the rounds, the exposed fraction the median of
the per-round fractions, and every round's figures are in the JSON.

    python -m benchmarks.ttft_overlap [--quick] [--transport tcp|rdma] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.cachestore_tcp import cachestore_run
from benchmarks.cluster_procs import NodeProc
from benchmarks.common import add_rounds_arg, alternate, emit, median_figures
from pdserve.cachestore import CacheStoreServer, MemoryRegion, PoolGeometry
from pdserve.engine import EngineConfig, LLMEngine
from pdserve.engine.builtin import default_model_dir

SECRET = "bench"


def kv_geometry(model_dir: Path, prompt_len: int, device: str = "cpu", dtype: str = "auto") -> PoolGeometry:
    """Layers x blocks x block bytes of one prompt's KV (what the transfer moves; dtype follows the device)."""
    pool = LLMEngine(EngineConfig(model_dir, num_kv_blocks=4, device=device, dtype=dtype)).runner.kv_pool
    return PoolGeometry(pool.num_layers, (prompt_len + pool.block_size - 1) // pool.block_size, pool.block_bytes)


async def prefill_rpc(
    prefill: str, geo: PoolGeometry, prompt: list[int], reps: int, transport: str = "tcp", salt: int = 0
) -> tuple[float, float]:
    """Median (RPC seconds, reported prefill compute seconds) with this process as the KV receiver.
    Token ids are shifted by `salt` + the repetition: a call with a salt no earlier call used (step
    reps + 1) hits no cached prefix."""
    import grpc

    from pdserve.node_runtime.auth import cluster_metadata
    from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

    server = CacheStoreServer(
        MemoryRegion.from_buffer(bytearray(geo.total_bytes)), geo, transport=transport, secret=SECRET
    )
    await server.start()
    rpc, compute = [], []
    try:
        async with grpc.aio.insecure_channel(prefill) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            meta = cluster_metadata(SECRET)
            compat = (await stub.GetLoad(common_pb2.LoadRequest(), metadata=meta)).compatibility
            for i in range(reps + 1):
                rid = f"p{len(prompt)}-{salt + i}"
                creds = server.open_session(rid, list(range(geo.num_blocks)), timeout=300)
                req = prefill_pb2.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=[t + salt + i for t in prompt],  # no prefix-cache hits
                    params=common_pb2.SamplingParams(temperature=0.0, max_tokens=1),
                    kv_destination=creds.to_bytes(),
                    compatibility=compat,
                )
                start = time.perf_counter()
                reply = await stub.Prefill(req, metadata=meta, timeout=600)
                rpc.append(time.perf_counter() - start)
                compute.append(reply.prefill_seconds)
                assert server.get_session(rid).state.value == "complete"
                server.close_session(rid)
    finally:
        await server.stop()
    return statistics.median(rpc[1:]), statistics.median(compute[1:])


async def decode_ttft(decode: str, prefill: str, prompt: list[int], reps: int, salt: int = 0) -> float:
    """Median seconds to the first token through the decode node (token ids shifted as `prefill_rpc`'s)."""
    import grpc

    from pdserve.node_runtime.auth import cluster_metadata
    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    times = []
    async with grpc.aio.insecure_channel(decode) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        for i in range(reps + 1):
            req = decode_pb2.GenerateRequest(
                request_id=f"t{len(prompt)}-{salt + i}",
                prompt_token_ids=[t + salt + i for t in prompt],
                params=common_pb2.SamplingParams(temperature=0.0, max_tokens=1),
                prefill_addresses=[prefill],
            )
            start = time.perf_counter()
            async for _ in stub.Generate(req, metadata=cluster_metadata(SECRET), timeout=600):
                times.append(time.perf_counter() - start)
                break
    return statistics.median(times[1:])


def exposure(prefill: dict, transfer: dict) -> dict:
    """One round's exposed transfer: the Prefill RPC's time beyond the compute, and that over the
    transfer alone."""
    exposed = max(0.0, prefill["rpc_s"] - prefill["compute_s"])
    return {"exposed_s": round(exposed, 4), "exposed_fraction": round(exposed / transfer["transfer_alone_s"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and a shorter long prompt")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the prefill node")
    parser.add_argument(
        "--device",
        default="cpu",
        help="device of both nodes (cuda: one GPU shared; the prefill node records a CUDA event "
        "per layer and stages through pinned host memory)",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "flashinfer"],
        help="attention backend of both nodes (auto: flashinfer on CUDA when importable)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype of both nodes (flashinfer needs float16 or bfloat16)",
    )
    parser.add_argument(
        "--transport",
        default="tcp",
        choices=["tcp", "rdma"],
        help="KV transport (rdma without a NIC here: the emulated verbs device, across processes)",
    )
    add_rounds_arg(parser)
    args = parser.parse_args()
    emulated = False
    if args.transport == "rdma":
        from pdserve.cachestore.rdma_verbs import EMULATOR_ENV, rdma_devices

        if not os.environ.get(EMULATOR_ENV) and not rdma_devices():
            os.environ[EMULATOR_ENV] = "1"  # no NIC: the emulated device (inherited by the nodes and receivers)
        emulated = os.environ.get(EMULATOR_ENV) == "1"
    if emulated:
        print("transport rdma on the EMULATED verbs device: timings say nothing about a NIC")
    model = default_model_dir("bench")
    lengths, reps = ([512, 1024], 1) if args.quick else ([512, 2048], 3)
    node_args = [
        "--port",
        "0",
        "--model",
        str(model),
        "--cluster-secret",
        SECRET,
        "--transport",
        args.transport,
        "--device",
        args.device,
        "--attention-backend",
        args.attention_backend,
        "--dtype",
        args.dtype,
    ]
    if args.device.startswith("cuda"):  # both nodes share one card: each sizes its pool from a share
        node_args += ["--gpu-memory-utilization", "0.3"]
    prefill = NodeProc("prefill", node_args + ["--num-threads", str(args.threads)])
    rows = {}
    try:
        decode = NodeProc("decode", node_args + ["--num-threads", "1"])
        try:
            for n in lengths:
                prompt = [10 + (i * 7919) % 1500 for i in range(n)]
                geo = kv_geometry(model, n, args.device, args.dtype)
                salts = itertools.count(0, reps + 1)  # a fresh salt per measured call: no cached prefix

                def prefill_arm() -> dict:
                    rpc, compute = asyncio.run(
                        prefill_rpc(prefill.address, geo, prompt, reps, args.transport, next(salts))
                    )
                    return {"rpc_s": round(rpc, 4), "compute_s": round(compute, 4)}

                def transfer_arm() -> dict:
                    best_gbps, _ = asyncio.run(cachestore_run(geo, max(reps, 2), 1, args.transport))
                    return {"transfer_alone_s": round(geo.total_bytes / (best_gbps * 1e9), 4)}

                def ttft_arm() -> dict:
                    ttft = asyncio.run(decode_ttft(decode.address, prefill.address, prompt, reps, next(salts)))
                    return {"disaggregated_ttft_s": round(ttft, 4)}

                runs = alternate({"prefill": prefill_arm, "transfer": transfer_arm, "ttft": ttft_arm}, args.rounds)
                per_round = [
                    {**r["prefill"], **r["transfer"], **r["ttft"]} | exposure(r["prefill"], r["transfer"])
                    for r in runs.rounds
                ]
                rows[n] = {
                    **{k: round(v, 4) for k, v in median_figures(per_round).items()},
                    "kv_mib": round(geo.total_bytes / 2**20, 1),
                    "rounds": per_round,
                }
                m = rows[n]
                print(
                    f"prompt {n} (medians of {args.rounds} rounds): compute {m['compute_s'] * 1e3:.0f} ms, Prefill "
                    f"RPC {m['rpc_s'] * 1e3:.0f} ms, transfer alone {m['transfer_alone_s'] * 1e3:.1f} ms "
                    f"({m['kv_mib']} MiB), exposed {m['exposed_s'] * 1e3:.1f} ms ({m['exposed_fraction']:.0%}), "
                    f"disaggregated TTFT {m['disaggregated_ttft_s'] * 1e3:.0f} ms"
                )
        except BaseException:  # a hung or failed run: show what the nodes said
            for name, node in (("prefill", prefill), ("decode", decode)):
                print(f"--- {name} node log tail ---\n" + node.tail(25), file=sys.stderr)
            raise
        finally:
            decode.stop()
    finally:
        prefill.stop()
    long = rows[lengths[-1]]
    emit(
        {
            "metric": f"exposed_transfer_fraction_{lengths[-1]}",
            "value": long["exposed_fraction"],
            "baseline": 1.0,
            "ratio": long["exposed_fraction"],
            "ratio_is": "median over the rounds of the exposed fraction",
            "target": 0.25,
            "threads": args.threads,
            "device": args.device,
            "transport": args.transport + (" (emulated)" if emulated else ""),
            "attention_backend": args.attention_backend,
            "dtype": args.dtype,
            "rows": rows,
        }
    )


if __name__ == "__main__":
    main()
