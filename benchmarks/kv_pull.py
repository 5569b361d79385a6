"""D->P pull vs recompute, measured end to end: the measurement behind `--kv-pull-min-blocks`.

Two prefill node processes (A, B) and two decode node processes, tcp CacheStore, one torch thread
each: `pull` runs `--kv-pull-min-blocks 1`, `recompute` runs `--kv-pull-min-blocks 0`. For each
size G (blocks) and repetition, a fresh G-block prefix is first prefilled through A (so the decode
node holds it and B does not), then prefix + 16 new tokens is sent through B: with `pull` B
receives the G held blocks from the decode node and computes only the new tokens; with
`recompute` B computes all of it. Modes alternate so both see the same machine load. TTFT =
first token at the client (the decode node's reply), median over repetitions.

    python -m benchmarks.kv_pull [--quick] [--sizes 1,2,4] [--model-size bench|tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from benchmarks.cluster_procs import NodeProc
from benchmarks.common import emit
from benchmarks.local_prefill import BLOCK, SECRET, ttft

MODES = ("pull", "recompute")


def fresh(k: int, n: int) -> list[int]:
    """n tokens no earlier prompt of the run starts with (k distinguishes them)."""
    return [11 + (k * 977 + j * 31) % 1450 for j in range(n)]


async def sweep(decodes: dict[str, str], a: str, b: str, sizes: list[int], reps: int) -> dict[int, dict[str, float]]:
    """Median TTFT (s) through B per prefix size, for each mode."""
    for mode, decode in decodes.items():  # first requests load kernels and connect: not measured
        await ttft(decode, f"warm-{mode}", fresh(0, 40), [a])
    out: dict[int, dict[str, list[float]]] = {g: {m: [] for m in MODES} for g in sizes}
    k = 0
    for rep in range(reps):
        for g in sizes:
            for mode in MODES if rep % 2 else reversed(MODES):
                k += 1
                prefix = fresh(k, g * BLOCK)
                decode = decodes[mode]
                await ttft(decode, f"hold-{mode}-{g}-{rep}", prefix + [5], [a])  # decode holds it, B does not
                tail = fresh(10_000 + k, BLOCK)
                out[g][mode].append(await ttft(decode, f"{mode}-{g}-{rep}", prefix + tail, [b]))
    return {g: {m: statistics.median(v) for m, v in modes.items()} for g, modes in out.items()}


def main() -> None:
    from pdserve.engine.builtin import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 sizes x 3 repetitions")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    parser.add_argument("--sizes", default=None, help="comma-separated prefix sizes in blocks (overrides the sweep)")
    args = parser.parse_args()
    model = str(default_model_dir(args.model_size))
    sizes, reps = ([2, 8, 32], 3) if args.quick else ([1, 2, 4, 8, 16, 32, 60], 5)
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
        medians = asyncio.run(sweep(decodes, a.address, b.address, sizes, reps))
    finally:
        for p in reversed(procs):
            p.stop()
    for g, m in sorted(medians.items()):
        print(f"G={g:>3} blocks: pull {m['pull'] * 1e3:7.1f} ms, recompute {m['recompute'] * 1e3:7.1f} ms", flush=True)
    pays = [g for g, m in sorted(medians.items()) if m["pull"] < m["recompute"]]
    emit(
        {
            "metric": "kv_pull_min_blocks",
            "value": pays[0] if pays else 0,
            "target": "smallest G (blocks held by decode, lacking on prefill) at which pull TTFT < recompute",
            "pull_ttft_ms": {g: round(m["pull"] * 1e3, 1) for g, m in sorted(medians.items())},
            "recompute_ttft_ms": {g: round(m["recompute"] * 1e3, 1) for g, m in sorted(medians.items())},
            "ratio": {g: round(m["pull"] / m["recompute"], 3) for g, m in sorted(medians.items())},
            "model": args.model_size,
        }
    )


if __name__ == "__main__":
    main()
