"""Multi-turn chat on a real `pdserve up` cluster (2 prefill + 2 decode, bench model): KV reuse
across the split against the no-reuse baseline, in the same run.

Every session opens with the same ~1k-token system prompt; each turn appends the previous answer
and a new user message (token-id prompts on /v1/completions, greedy). The answer is appended as
the token ids the server generated (`return_token_ids`, as vLLM offers it), not as its text
re-encoded: the bench model's greedy answers do not survive a decode/encode round trip (16
generated ids re-encode to ~36 other ids), so a text client's history would hold tokens no
server ever saw, which no cache can hit. Turns run in lockstep rounds
(all sessions' turn t at once), so the KV bytes the decode nodes received (their CacheStore
counters) can be split into turn 1 and turns >= 2. The reuse arm runs `--kv-reuse on` (with
`--routing kv-aware` when `pdserve up` offers it), the baseline `--kv-reuse off` (`--routing wrr`),
and with `--vllm-python` a `vllm serve` with prefix caching in its default mode. The arms run one at
a time, each on a fresh server, alternating their order over `--rounds` rounds (default 3); every
figure reported is the median over the rounds (ratios: the median of the per-round ratios), and
the per-round figures are in the result line (`rounds`).

Two workloads (`--workload`): `chat` (the default, on which `--local-prefill-max-tokens`' default
was tuned): user turns of 20-50 corpus words (about 35-85 tokens) and 16-token answers (32 without
--quick); `docs`, for checking that default on a workload it was not tuned on: each user turn pastes
a passage of 40-200 words (about 45-285 tokens) and answers are 48 tokens, so a later turn's
uncached part (answer + turn) is about 90-330 tokens, above the default and around other values.
`--local-prefill-arms N,M` adds a reuse arm per threshold, alternated in the same rounds as the
others (`local_prefill` in the result line: each arm's TTFT p50 and its ratio to the default's, per
round and median).

    python -m benchmarks.multiturn [--quick] [--rounds N] [--vllm-python PATH] [--workload chat|docs]
        [--local-prefill-arms N,M]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import subprocess
import sys
import time

import httpx

from benchmarks.cluster_procs import ROOT
from benchmarks.common import add_rounds_arg, alternate, emit, median_figures, pct
from benchmarks.multiturn_probe import round_line, scrape
from benchmarks.multiturn_servers import VLLM_MODE, free_port, start_up, start_vllm, stop

BLOCK = 16


WORKLOADS = {"chat": (20, 50), "docs": (40, 200)}
"""Workload name -> (shortest, longest) user turn in corpus words (about a token each)."""
ANSWER_TOKENS = {"chat": (16, 32), "docs": (48, 48)}
"""Workload name -> answer length (--quick, full)."""


def workload(
    tokenizer, sessions: int, turns: int, seed: int, turn_words: tuple[int, int] = WORKLOADS["chat"]
) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt (~1k tokens of corpus text) and each session's user messages."""
    text = (ROOT / "pdserve" / "engine" / "data" / "corpus.txt").read_text().split()
    rng = random.Random(seed)
    system: list[int] = []
    while len(system) < 1000:
        start = rng.randrange(len(text) - 40)
        system += tokenizer.encode(" ".join(text[start : start + 40]), add_special_tokens=not system)
    users = [
        [
            tokenizer.encode(" ".join(text[s : s + rng.randrange(*turn_words)]), False)
            for s in rng.sample(range(len(text) - turn_words[1] - 10), turns)
        ]
        for _ in range(sessions)
    ]
    return system[:1000], users


async def one_turn(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    start, ttft, text, cached, ids = time.perf_counter(), None, "", 0, []
    async with client.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed a turn: {chunk['error']}")
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in chunk["choices"]:
                if choice["text"] or choice.get("token_ids"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                text += choice["text"]
                ids += choice.get("token_ids") or []
    return {"ttft": ttft or float("nan"), "text": text, "ids": ids, "cached": cached, "prompt_tokens": len(prompt)}


async def run_workload(url: str, model: str, system, users, max_tokens: int, metrics: list[str], block_bytes) -> dict:
    """All sessions, turn by turn; per turn >= 2: TTFT, cached tokens, and its block-aligned bound.
    `metrics`: the /metrics URLs of the router and the decode nodes (none: no wire accounting)."""
    histories = [list(system) for _ in users]
    texts: list[str] = []
    later: dict = {"ttft": [], "cached": 0, "prompt": 0, "bound": 0, "kv_bytes": 0.0, "pulled_bytes": 0.0, "rounds": []}
    async with httpx.AsyncClient() as client:
        for t in range(len(users[0])):
            before = scrape(metrics)
            prompts = [h + u[t] for h, u in zip(histories, users)]
            results = await asyncio.gather(*[one_turn(client, url, model, p, max_tokens) for p in prompts])
            new_blocks = 0
            for i, (h, p, res) in enumerate(zip(histories, prompts, results)):
                seen = min(len(h), len(p) - 1) // BLOCK * BLOCK  # history the cluster has seen
                new_blocks += -(-len(p) // BLOCK) - seen // BLOCK
                if t >= 1:  # turn 1 ships the system prompt at least once per node
                    later["ttft"].append(res["ttft"])
                    later["cached"] += res["cached"]
                    later["prompt"] += len(p)
                    later["bound"] += seen
                histories[i] = p + res["ids"]
                texts.append(res["text"])
            line = round_line(t, before, scrape(metrics), new_blocks, block_bytes)
            print(json.dumps(line), flush=True)
            later["rounds"].append(line)
            later["kv_bytes"] += line["kv_bytes"] if t >= 1 else 0.0
            later["pulled_bytes"] += line["pulled_bytes"] if t >= 1 else 0.0
    later["texts"] = texts
    return later


def run_arm(model: str, extra: list[str], system, users, max_tokens: int) -> dict:
    port, metrics = free_port(), free_port()  # node metrics on metrics..metrics+3: prefill 0-1, decode 2-3
    proc = start_up(model, port, metrics, extra)
    try:
        urls = [f"http://127.0.0.1:{p}/metrics" for p in (port, metrics + 2, metrics + 3)]
        url = f"http://127.0.0.1:{port}/v1/completions"
        name = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]  # as served
        return asyncio.run(run_workload(url, name, system, users, max_tokens, urls, kv_block_bytes(model)))
    finally:
        stop(proc)


def kv_block_bytes(model: str) -> float:
    """Bytes of one block of KV over all layers (fp32, as the nodes run): what a block costs on the wire."""
    import torch

    from pdserve.engine.kv_pool import kv_bytes_per_token
    from pdserve.engine.model_config import ModelConfig

    config = ModelConfig.from_dir(model)
    return float(kv_bytes_per_token(config, config.num_hidden_layers, torch.float32) * BLOCK)


def run_vllm(python: str, model: str, system, users, max_tokens: int) -> dict:
    """The same workload against `vllm serve` with prefix caching (fp32 on CPU, like the nodes; all
    usable cores for its OpenMP threads, as ../shared/MACHINE.md says)."""
    port = free_port()
    extra = ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--served-model-name", "vllm"]
    proc = start_vllm(python, model, port, extra)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        return asyncio.run(run_workload(url, "vllm", system, users, max_tokens, [], 0.0))
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    parser.add_argument("--vllm-python", default=None, help="python of a vLLM install: also run `vllm serve`")
    parser.add_argument("--seed", type=int, default=0)
    add_rounds_arg(parser)
    parser.add_argument(
        "--local-prefill-max-tokens",
        default=None,
        help="for the reuse arm's nodes (default: pdserve's; 0: every turn remote)",
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="chat", help="see the module's docstring")
    parser.add_argument(
        "--local-prefill-arms",
        default="",
        help="comma-separated --local-prefill-max-tokens values, one more reuse arm each (e.g. 0,256)",
    )
    parser.add_argument(
        "--kv-pull-min-blocks",
        default=None,
        help="for the reuse arm's decode nodes (default: pdserve's; 0: no D->P pull)",
    )
    args = parser.parse_args()
    from pdserve.engine.builtin import default_model_dir
    from pdserve.engine.tokenizer import Tokenizer

    model = str(default_model_dir(args.model_size))
    tokenizer = Tokenizer(model)
    sessions, turns = (4, 3) if args.quick else (12, 5)
    max_tokens = ANSWER_TOKENS[args.workload][0 if args.quick else 1]
    system, users = workload(tokenizer, sessions, turns, args.seed, WORKLOADS[args.workload])
    try:
        thresholds = [int(v) for v in args.local_prefill_arms.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--local-prefill-arms: whole numbers separated by commas, got {args.local_prefill_arms!r}")
    if any(n < 0 for n in thresholds):
        parser.error(f"--local-prefill-arms: thresholds must be >= 0, got {args.local_prefill_arms!r}")
    routing = (
        "--routing"
        in subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "up", "--help"], cwd=ROOT, capture_output=True, text=True
        ).stdout
    )
    reuse_flags = ["--kv-reuse", "on"] + (["--routing", "kv-aware"] if routing else [])
    if args.local_prefill_max_tokens is not None:
        reuse_flags += ["--local-prefill-max-tokens", args.local_prefill_max_tokens]
    if args.kv_pull_min_blocks is not None:
        reuse_flags += ["--kv-pull-min-blocks", args.kv_pull_min_blocks]
    base_flags = ["--kv-reuse", "off"] + (["--routing", "wrr"] if routing else [])
    arms = {
        "reuse": lambda: run_arm(model, reuse_flags, system, users, max_tokens),
        "base": lambda: run_arm(model, base_flags, system, users, max_tokens),
    }
    for n in thresholds:  # the reuse arm with another --local-prefill-max-tokens (the last one given wins)
        flags = reuse_flags + ["--local-prefill-max-tokens", str(n)]
        arms[f"reuse@{n}"] = functools.partial(run_arm, model, flags, system, users, max_tokens)
    if args.vllm_python:
        arms["vllm"] = lambda: run_vllm(args.vllm_python, model, system, users, max_tokens)
    ran = alternate(arms, args.rounds, optional={"vllm"})
    runs = ran.rounds
    per_round = [
        summarize(r["reuse"], r["base"], routing)
        | versus_vllm(r["reuse"], r.get("vllm"))
        | thresholds_vs(r, thresholds)
        for r in runs
    ]
    result = median_figures(per_round)
    if "vllm" in ran.errors:
        result["vllm_error"] = ran.errors["vllm"]
    if args.vllm_python:
        result["vllm_mode"] = VLLM_MODE
    if thresholds:
        result["local_prefill"] = {
            str(n): {
                "ttft_p50": result[f"reuse@{n}_ttft_p50"],
                "ratio_to_default": result[f"reuse@{n}_ratio_to_default"],
                "ratio_per_round": [r[f"reuse@{n}_ratio_to_default"] for r in per_round],
            }
            for n in thresholds
        }
        result["local_prefill_default"] = args.local_prefill_max_tokens or "pdserve's"
    emit(
        {
            **result,
            "rounds": per_round,
            "workload": args.workload,
            "sessions": sessions,
            "turns": turns,
            "max_tokens": max_tokens,
            "model": args.model_size,
        }
    )


def thresholds_vs(arms: dict, thresholds: list[int]) -> dict:
    """One round's TTFT p50 (turns >= 2) of each extra --local-prefill-max-tokens arm, and its ratio to
    the reuse arm's (the default threshold's; above 1: the default was faster); identical text too."""
    default = pct(arms["reuse"]["ttft"], 0.5)
    out: dict = {}
    for n in thresholds:
        arm = arms[f"reuse@{n}"]
        out[f"reuse@{n}_ttft_p50"] = round(pct(arm["ttft"], 0.5), 4)
        out[f"reuse@{n}_ratio_to_default"] = round(pct(arm["ttft"], 0.5) / default, 3)
        out[f"reuse@{n}_identical"] = arm["texts"] == arms["reuse"]["texts"]
    return out


def versus_vllm(reuse: dict, peer: dict | None) -> dict:
    """One round's figures of the vLLM arm and pdserve's reuse arm against it (none if it did not run)."""
    if peer is None:
        return {}
    return {
        "vllm_ttft_p50": round(pct(peer["ttft"], 0.5), 4),
        "vllm_ttft_p99": round(pct(peer["ttft"], 0.99), 4),
        "vllm_ttft_p50_ratio": round(pct(reuse["ttft"], 0.5) / pct(peer["ttft"], 0.5), 3),
        "vllm_ttft_p99_ratio": round(pct(reuse["ttft"], 0.99) / pct(peer["ttft"], 0.99), 3),
        "vllm_cached_fraction": round(peer["cached"] / peer["prompt"], 4),
        "vllm_identical": peer["texts"] == reuse["texts"],
    }


def summarize(reuse: dict, base: dict, routing: bool) -> dict:
    p50, b50 = pct(reuse["ttft"], 0.5), pct(base["ttft"], 0.5)
    new_share = 1 - reuse["bound"] / reuse["prompt"]
    print(
        f"turns>=2: TTFT p50 {p50:.3f}s vs {b50:.3f}s, p99 {pct(reuse['ttft'], 0.99):.3f}s vs "
        f"{pct(base['ttft'], 0.99):.3f}s; KV bytes {reuse['kv_bytes']:.0f} vs {base['kv_bytes']:.0f}; "
        f"cached {reuse['cached']}/{reuse['prompt']} (bound {reuse['bound']})",
        flush=True,
    )
    return {
        "metric": "multiturn_ttft_p50_turns2plus_s",
        "value": round(p50, 4),
        "baseline": round(b50, 4),
        "ratio": round(p50 / b50, 3),
        "target": "ratio <= 0.5; wire_bytes_ratio <= 1.1 x new_token_share; cached_fraction >= 0.9 x bound",
        "ttft_p99": round(pct(reuse["ttft"], 0.99), 4),
        "baseline_ttft_p99": round(pct(base["ttft"], 0.99), 4),
        "wire_bytes_ratio": round(reuse["kv_bytes"] / base["kv_bytes"], 4) if base["kv_bytes"] else None,
        "pull_bytes_ratio": round(reuse["pulled_bytes"] / base["kv_bytes"], 4) if base["kv_bytes"] else None,
        "new_token_share": round(new_share, 4),
        "cached_fraction": round(reuse["cached"] / reuse["prompt"], 4),
        "cached_bound": round(reuse["bound"] / reuse["prompt"], 4),
        "baseline_cached_fraction": round(base["cached"] / base["prompt"], 4),
        "identical": reuse["texts"] == base["texts"],
        "routing_flag": routing,
    }


if __name__ == "__main__":
    main()
