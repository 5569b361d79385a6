"""Runs benchmarks/agentic.py's visits on vLLM CPU, one at a time, for its `vllm` arm.

Executed with the Python of vLLM's own virtualenv (scripts/install_vllm_cpu.sh); it imports
nothing from this repository. It builds vLLM's engine (its defaults: compiled path, prefix
caching on) with a KV cache of exactly POOL_BYTES, as the pdserve arms get, then sends each visit
of VISITS.json ([[session, prompt token ids], ...]) alone and steps the engine until it ends,
timing the first step that returns a token, as the pdserve arms time theirs. With OFFLOAD_GIB > 0
it asks for vLLM's native CPU offloading (`kv_offloading_size`) too. Writes OUT.json:
{"block_size", "wall_s", "visits": [[session, ttft_s, cached_tokens, generated, seconds], ...],
"token_ids": [...]}.

    .venv-vllm/bin/python benchmarks/vllm_agentic_worker.py MODEL_DIR POOL_BYTES THREADS MAX_TOKENS \
        VISITS.json OUT.json [OFFLOAD_GIB]
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> None:
    model_dir, pool_bytes, threads, max_tokens, visits_path, out_path = argv[:6]
    offload_gib = float(argv[6]) if len(argv) > 6 else 0.0
    # vLLM's defaults on this machine compute on one core; bind exactly `threads` cores
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{int(threads) - 1}")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(visits_path) as f:
        visits = json.load(f)
    longest = max(len(prompt) for _, prompt in visits) + int(max_tokens)
    extra = {"kv_offloading_size": offload_gib} if offload_gib > 0 else {}
    llm = LLM(
        model=model_dir,
        dtype="float32",
        kv_cache_memory_bytes=int(pool_bytes),
        enable_prefix_caching=True,
        max_model_len=longest,
        seed=0,
        **extra,
    )
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    rows, token_ids = [], []
    started = time.perf_counter()
    for i, (session, prompt) in enumerate(visits):
        t0 = time.perf_counter()
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), params)
        first, cached, ids = None, 0, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs and out.outputs[0].token_ids:
                    first = time.perf_counter() - t0
                if out.finished:
                    cached, ids = out.num_cached_tokens or 0, list(out.outputs[0].token_ids)
        rows.append([session, first or 0.0, cached, len(ids), time.perf_counter() - t0])
        token_ids.append(ids)
    wall = time.perf_counter() - started
    block_size = engine.vllm_config.cache_config.block_size
    with open(out_path + ".tmp", "w") as f:  # appears whole
        json.dump({"block_size": block_size, "wall_s": wall, "visits": rows, "token_ids": token_ids}, f)
    os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main(sys.argv[1:])
