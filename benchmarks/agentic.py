"""Agent-style revisits of long private contexts: the host KV tier and the shared store against no tier, one engine.

    python -m benchmarks.agentic [--quick]

Workload: S sessions, each with its own long context (no prefix shared between sessions), visited
round robin; each visit sends the session's context plus everything said so far plus a new step,
and generates a short reply. The pool holds a third of the sessions' contexts or less, so
without a tier every revisit finds its context evicted and recomputes it.

Arms, on the bench model (float32, one engine in this process, its default CPU settings but the
pool, which both arms get at the same fixed size, `--kv-cache-memory`, so that the working set is
at least 3x the pool):

  * `off`: no tier (today's default);
  * `host`: `--kv-offloading-size` (a host tier the size of the whole working set);
  * `store`: `--kv-store file://DIR` alone (a fresh directory each round, on this machine's disk):
    the shared store's path (a file per block, checked on read) in place of the host tier.

Requests run one at a time, so TTFT is the prefill a visit needs. Measured on revisits (visits
after a session's first): TTFT p50, the cached fraction of the reuse bound (prompt tokens the
engine did not compute over the block-aligned tokens the session already had), and throughput
(generated tokens over the wall time of the whole run), and each tier's restore bandwidth (bytes
restored over the time restores took). Arms alternate their order over the rounds; each figure is the
median over rounds, the per-round figures are kept. `ratio` is off's revisit TTFT
p50 over host's; the issue's targets: TTFT <= 0.3x (ratio >= 3.3), cached fraction >= 0.8,
throughput >= 2x.

This is an engine-level measurement (no router, nodes or HTTP), so it isolates the tier. There is
no vLLM arm yet: vLLM 0.32 has `--kv-offloading-size` (its OffloadingConnector), but whether it
runs on vLLM's CPU platform has not been tried here.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable

from benchmarks.common import add_rounds_arg, alternate, emit, median_figures, pct


def workload(sessions: int, context: int, visits: int, step: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(session, prompt) in visit order: round robin, each prompt its session's whole history."""
    rng = random.Random(seed)
    history = [[rng.randrange(100, 30000) for _ in range(context)] for _ in range(sessions)]
    out = []
    for _ in range(visits):
        for s in range(sessions):
            history[s] = history[s] + [rng.randrange(100, 30000) for _ in range(step)]
            out.append((s, list(history[s])))
    return out


def run_arm(
    model: str, pool_bytes: int, tier_bytes: int | None, requests, max_tokens: int, store: str | None = None
) -> dict:
    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model_dir=model,
            dtype="float32",
            kv_cache_bytes=pool_bytes,
            kv_offloading_bytes=tier_bytes,
            kv_store=store,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    bs = engine.block_manager.block_size
    seen: dict[int, int] = {}
    ttft, cached, bound, generated = [], 0, 0, 0
    started = time.perf_counter()
    for i, (session, prompt) in enumerate(requests):
        t0 = time.perf_counter()
        engine.add_request(str(i), prompt, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - t0
                generated += len(out.new_token_ids)
                if out.finished:
                    hit = out.num_cached_tokens
        if session in seen:  # a revisit: what it could have reused is what the session had before
            ttft.append(first or 0.0)
            cached += hit
            bound += seen[session] // bs * bs
        seen[session] = len(prompt) + max_tokens - 1
        if engine.tier is not None:  # the writer runs beside the engine: let it catch up as a user's think time would
            while engine.tier._pending:
                time.sleep(0.001)
        if engine.store is not None:
            engine.store.drain(30)
    wall = time.perf_counter() - started
    engine.close()
    tier = engine.tier or engine.store
    stats = tier.stats if tier is not None else None
    return {
        "revisit_ttft_p50_s": round(pct(ttft, 0.5), 4),
        "cached_fraction": round(cached / bound, 3) if bound else 0.0,
        "throughput_tok_s": round(generated / wall, 2),
        "restored_blocks": stats.restored_blocks if stats else 0,
        "restore_gb_s": round(stats.restored_bytes / stats.restore_seconds / 1e9, 3)
        if stats and stats.restore_seconds
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    add_rounds_arg(parser)
    args = parser.parse_args()
    from pdserve.engine.builtin import default_model_dir
    from pdserve.engine.kv_pool import kv_bytes_per_token
    from pdserve.engine.model_config import ModelConfig

    import torch

    model = str(default_model_dir("bench"))
    sessions, context, visits, step, max_tokens = (6, 512, 3, 16, 8) if args.quick else (8, 1024, 4, 32, 16)
    cfg = ModelConfig.from_dir(model)
    per_token = kv_bytes_per_token(cfg, cfg.num_hidden_layers, torch.float32)
    working_set = sessions * (context + visits * (step + max_tokens))
    pool_bytes = per_token * working_set // 3  # the working set is 3x the pool
    tier_bytes = per_token * working_set * 2
    requests = workload(sessions, context, visits, step)

    def arm(name: str) -> Callable[[], dict]:
        def run() -> dict:
            with tempfile.TemporaryDirectory(prefix="pdserve-agentic-store-") as directory:
                store = f"file://{directory}" if name == "store" else None
                tier = tier_bytes if name == "host" else None
                return run_arm(model, pool_bytes, tier, requests, max_tokens, store)

        return run

    ran = alternate({name: arm(name) for name in ("off", "host", "store")}, args.rounds)
    rounds = {name: [r[name] for r in ran.rounds] for name in ("off", "host", "store")}
    medians = {name: median_figures(per_round) for name, per_round in rounds.items()}

    def median(name: str, key: str) -> float:
        return medians[name][key] or 0.0

    off_ttft, host_ttft = median("off", "revisit_ttft_p50_s"), median("host", "revisit_ttft_p50_s")
    emit(
        {
            "metric": "agentic_revisit_ttft_p50_s",
            "value": host_ttft,
            "baseline": off_ttft,
            "ratio": round(off_ttft / host_ttft, 3) if host_ttft else None,
            "target": round(1 / 0.3, 3),
            "cached_fraction": median("host", "cached_fraction"),
            "cached_fraction_off": median("off", "cached_fraction"),
            "throughput_ratio": round(median("host", "throughput_tok_s") / median("off", "throughput_tok_s"), 3),
            "store": {
                "revisit_ttft_p50_s": median("store", "revisit_ttft_p50_s"),
                "ttft_ratio": round(off_ttft / median("store", "revisit_ttft_p50_s"), 3)
                if median("store", "revisit_ttft_p50_s")
                else None,
                "cached_fraction": median("store", "cached_fraction"),
                "throughput_ratio": round(median("store", "throughput_tok_s") / median("off", "throughput_tok_s"), 3),
            },
            "restore_gb_s": {"host": median("host", "restore_gb_s"), "store": median("store", "restore_gb_s")},
            "workload": {
                "sessions": sessions,
                "context_tokens": context,
                "visits": visits,
                "step_tokens": step,
                "max_tokens": max_tokens,
                "pool_tokens": pool_bytes // per_token,
                "working_set_tokens": working_set,
            },
            "level": "one engine in-process (no router, nodes or HTTP); every arm the same fixed pool",
            "peer": "not run: vLLM's --kv-offloading-size on its CPU platform has not been tried here",
            "rounds": rounds,
        }
    )


if __name__ == "__main__":
    main()
