"""D->P pull vs recompute, measured end to end: the measurement behind `--kv-pull-min-blocks`.

Two prefill node processes (A, B) and two decode node processes, tcp CacheStore, one torch thread
each: `pull` runs `--kv-pull-min-blocks 1`, `recompute` runs `--kv-pull-min-blocks 0`. For each
size G (blocks) and repetition, a fresh G-block prefix is first prefilled through A (so the decode
node holds it and B does not), then prefix + 16 new tokens is sent through B: with `pull` B
receives the G held blocks from the decode node and computes only the new tokens; with
`recompute` B computes all of it. Each of `--rounds` rounds runs every size both ways, the first
mode reversing every round, so both see the same machine load. TTFT = first token at the client
(the decode node's reply), median over the rounds; every round's TTFTs and the per-size median of
the paired per-round ratios pull / recompute are in the JSON.

    python -m benchmarks.kv_pull [--quick] [--sizes 1,2,4] [--model-size bench|tiny] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio

from benchmarks.cluster_procs import NodeProc
from benchmarks.common import Rounds, add_rounds_arg, emit
from benchmarks.local_prefill import BLOCK, SECRET, paired_sweep, sweep_json, sweep_medians, ttft

MODES = ("pull", "recompute")


def fresh(k: int, n: int) -> list[int]:
    """n tokens no earlier prompt of the run starts with (k distinguishes them)."""
    return [11 + (k * 977 + j * 31) % 1450 for j in range(n)]


async def sweep(decodes: dict[str, str], a: str, b: str, sizes: list[int], rounds: int) -> Rounds:
    """TTFT (s) through B per prefix size, for each mode, per round."""
    for mode, decode in decodes.items():  # first requests load kernels and connect: not measured
        await ttft(decode, f"warm-{mode}", fresh(0, 40), [a])
    k = 0

    async def measure(mode: str, g: int, r: int) -> float:
        nonlocal k
        k += 1
        prefix = fresh(k, g * BLOCK)
        decode = decodes[mode]
        await ttft(decode, f"hold-{mode}-{g}-{r}", prefix + [5], [a])  # decode holds it, B does not
        tail = fresh(10_000 + k, BLOCK)
        return await ttft(decode, f"{mode}-{g}-{r}", prefix + tail, [b])

    for mode in MODES:  # and a first pull from B opens its CacheStore connection: not measured either
        await measure(mode, min(sizes), -1)
    return await paired_sweep(sizes, rounds, MODES, measure)


def main() -> None:
    from pdserve.engine.builtin import default_model_dir
    from pdserve.node_runtime.node_config import DEFAULT_KV_PULL_MIN_BLOCKS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 sizes instead of 7")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    parser.add_argument("--sizes", default=None, help="comma-separated prefix sizes in blocks (overrides the sweep)")
    add_rounds_arg(parser, default=5)
    args = parser.parse_args()
    model = str(default_model_dir(args.model_size))
    sizes = [2, 8, 32] if args.quick else [1, 2, 4, 8, 16, 32, 60]
    if args.sizes:
        sizes = [int(g) for g in args.sizes.split(",")]
    common = ["--port", "0", "--model", model, "--cluster-secret", SECRET, "--num-threads", "1"]
    procs: list[NodeProc] = []
    try:
        a, b = NodeProc("prefill", common), None
        procs.append(a)
        b = NodeProc("prefill", common)
        procs.append(b)
        decodes = {}
        for mode, least in (("pull", "1"), ("recompute", "0")):
            flags = ["--local-prefill-max-tokens", "0", "--kv-pull-min-blocks", least]
            procs.append(NodeProc("decode", common + flags))
            decodes[mode] = procs[-1].address
        runs = asyncio.run(sweep(decodes, a.address, b.address, sizes, args.rounds))
    finally:
        for p in reversed(procs):
            p.stop()
    medians = sweep_medians(runs)
    for g, m in sorted(medians.items()):
        print(f"G={g:>3} blocks: pull {m['pull'] * 1e3:7.1f} ms, recompute {m['recompute'] * 1e3:7.1f} ms", flush=True)
    figures = sweep_json(runs, MODES)
    pays = [g for g, ratio in figures["pull_over_recompute"].items() if ratio is not None and ratio < 1]
    emit(
        {
            "metric": "kv_pull_min_blocks",
            "value": pays[0] if pays else 0,
            "baseline": DEFAULT_KV_PULL_MIN_BLOCKS,
            "baseline_is": "the default --kv-pull-min-blocks",
            "ratio": round(pays[0] / DEFAULT_KV_PULL_MIN_BLOCKS, 3) if pays else None,
            "target": "smallest G (blocks held by decode, lacking on prefill) at which pull TTFT < recompute "
            "(median of the paired ratios)",
            **figures,
            "model": args.model_size,
        }
    )


if __name__ == "__main__":
    main()
