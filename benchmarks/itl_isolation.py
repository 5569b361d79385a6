"""Decode inter-token latency while long prompts keep arriving: disaggregated vs colocated.

Steady greedy streams run on a decode node while 1024-token prompts arrive
back to back. Disaggregated: the prompts are computed by a separate prefill
node process and their KV streamed in. Colocated: the same decode node
computes them itself (`--colocated`, chunked prefill mixed into decode steps).
Same model, and the same cores for both arms: the CPUs this process may use are split between the
prefill and the decode node as `pdserve up --num-threads auto` splits them (each pinned to its own
CPUs, torch threads = its CPUs), and the colocated node gets all of them (pinned to the same CPUs,
as many threads). Reports ITL p50/p99 of the steady streams: the arms alternate over --rounds
(default 3), each figure the median of its rounds, the ratio the median of the per-round ratios.

    python -m benchmarks.itl_isolation [--quick] [--model-size bench|tiny]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from benchmarks.cluster_procs import NodeProc
from benchmarks.common import alternate, emit, median_figures, node_bench_args, pct
from pdserve.commands.core_split import Share, split_cores

SECRET = "bench"


async def run_mode(decode: str, prefill: list[str], streams: int, tokens: int, long_len: int) -> list[float]:
    import grpc

    from pdserve.node_runtime.auth import cluster_metadata
    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    meta = cluster_metadata(SECRET)
    gaps: list[float] = []
    done = asyncio.Event()
    async with grpc.aio.insecure_channel(decode) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)

        async def steady(i: int) -> None:
            req = decode_pb2.GenerateRequest(
                request_id=f"s{i}-{time.monotonic_ns()}",
                prompt_token_ids=[10 + i, 11, 12],
                params=common_pb2.SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                prefill_addresses=prefill,
            )
            last = None
            async for event in stub.Generate(req, metadata=meta, timeout=600):
                now = time.perf_counter()
                if last is not None and event.token_ids:
                    gaps.append(now - last)
                last = now

        async def intruders() -> None:
            k = 0
            while not done.is_set():
                prompt = [10 + (k * 31 + j) % 1500 for j in range(long_len)]
                req = decode_pb2.GenerateRequest(
                    request_id=f"long-{k}-{time.monotonic_ns()}",
                    prompt_token_ids=prompt,
                    params=common_pb2.SamplingParams(temperature=0.0, max_tokens=1),
                    prefill_addresses=prefill,
                )
                async for _ in stub.Generate(req, metadata=meta, timeout=600):
                    pass
                k += 1

        intruder = asyncio.create_task(intruders())
        await asyncio.sleep(0.2)
        await asyncio.gather(*[steady(i) for i in range(streams)])
        done.set()
        await intruder
    return gaps


def shares(cpus: list[int]) -> dict[str, Share]:
    """Both arms' node shares of `cpus`: disaggregated as `up`'s auto split of 1 prefill + 1 decode
    node, colocated all of them for its one node (with fewer than 2 CPUs: 1 thread each, unpinned)."""
    prefill, decode = split_cores(cpus, [("prefill", 1), ("decode", 1)])
    colocated = Share(len(cpus), frozenset(cpus) if prefill.cpus else None)
    return {"prefill": prefill, "decode": decode, "colocated": colocated}


def node_args(common: list[str], share: Share) -> list[str]:
    """The shared node flags with `--num-threads` set to the share's threads."""
    at = common.index("--num-threads")
    return common[:at] + ["--num-threads", str(share.threads)] + common[at + 2 :]


def figures(gaps: list[float]) -> dict:
    """One arm's ITL figures of one round."""
    return {
        "itl_p50_ms": round(statistics.median(gaps) * 1e3, 2),
        "itl_p99_ms": round(pct(gaps, 0.99) * 1e3, 2),
        "samples": len(gaps),
    }


def main() -> None:
    args, _, common = node_bench_args(__doc__.splitlines()[0], SECRET, rounds=True)
    streams, tokens, long_len = (4, 40, 512) if args.quick else (8, 150, 1024)
    split = shares(sorted(os.sched_getaffinity(0)))
    where = {k: sorted(v.cpus) if v.cpus else "unpinned" for k, v in split.items()}
    print("threads: " + ", ".join(f"{k} {v.threads} (CPUs {where[k]})" for k, v in split.items()), flush=True)

    def disaggregated() -> dict:  # 1 prefill + 1 decode process
        prefill = NodeProc("prefill", node_args(common, split["prefill"]), cpus=split["prefill"].cpus)
        try:
            decode = NodeProc("decode", node_args(common, split["decode"]), cpus=split["decode"].cpus)
            try:
                return figures(asyncio.run(run_mode(decode.address, [prefill.address], streams, tokens, long_len)))
            finally:
                decode.stop()
        finally:
            prefill.stop()

    def colocated() -> dict:  # the decode node computes the prompts itself, on the same cores
        share = split["colocated"]
        colo = NodeProc("decode", node_args(common, share) + ["--colocated"], cpus=share.cpus)
        try:
            return figures(asyncio.run(run_mode(colo.address, [], streams, tokens, long_len)))
        finally:
            colo.stop()

    rounds = alternate({"disaggregated": disaggregated, "colocated": colocated}, args.rounds)
    summary = {mode: median_figures(rounds.of(mode)) for mode in ("disaggregated", "colocated")}
    d, c = summary["disaggregated"], summary["colocated"]
    for mode, s in summary.items():
        print(f"{mode}: ITL p50 {s['itl_p50_ms']} ms, p99 {s['itl_p99_ms']} ms (median of {args.rounds} rounds)")
    ratios = rounds.ratios("disaggregated", "colocated", "itl_p99_ms")
    emit(
        {
            "metric": "itl_p99_ms_disaggregated",
            "value": d["itl_p99_ms"],
            "baseline": c["itl_p99_ms"],
            "ratio": round(statistics.median(ratios), 3),
            "ratio_per_round": [round(r, 3) for r in ratios],
            "target": "< 1 (lower is better)",
            "model": args.model_size,
            "threads": {k: v.threads for k, v in split.items()},
            "cpus": {k: sorted(v.cpus) if v.cpus else None for k, v in split.items()},
            **{f"{m}_{k}": v for m, s in summary.items() for k, v in s.items()},
            "per_round": rounds.rounds,
        }
    )


if __name__ == "__main__":
    main()
