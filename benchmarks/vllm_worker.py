"""Runs one workload on vLLM CPU and writes its timing and token ids as JSON to OUT.json.

Executed by benchmarks/engine_vs_vllm.py with the Python of vLLM's own virtualenv
(scripts/install_vllm_cpu.sh); it imports nothing from this repository, because
that virtualenv does not have pdserve installed.

(a file, because vLLM keeps logging to stdout while it shuts down)

    .venv-vllm/bin/python benchmarks/vllm_worker.py MODEL_DIR DTYPE THREADS WORKLOAD.json OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(model_dir: str, dtype: str, threads: int, workload_path: str, out_path: str) -> None:
    # vLLM's defaults on this machine compute on one core; bind exactly `threads` cores
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(workload_path) as f:
        reqs = json.load(f)
    llm = LLM(model=model_dir, dtype=dtype, max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=1024, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    with open(out_path, "w") as f:
        json.dump({"seconds": seconds, "tokens": sum(map(len, token_ids)), "token_ids": token_ids}, f)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
