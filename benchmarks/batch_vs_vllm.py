"""`pdserve batch` (TD-Pipe over 2 stages) vs vLLM CPU's `run-batch`, end to end, on one JSONL file.

Both read the same OpenAI Batch file (greedy /v1/chat/completions lines of random words, ignore_eos,
on the built-in `bench` model, float32; vLLM's run-batch serves no other endpoint) and write their
results; each is timed from process start to exit, as a user waits for it: start-up, model load,
vLLM's compile, pdserve's stage profiling.
pdserve runs twice against one profile cache: cold (profiles the stages) and warm (a rerun reuses
the profile); the ratio is the warm run's, both are printed. Output tok/s = completion tokens of the
output file / wall seconds. Also counts lines whose text is identical between the two.

vLLM runs from its own virtualenv (`scripts/install_vllm_cpu.sh`, found with `--vllm-python`) as
`python -m vllm.entrypoints.openai.run_batch`, bound to the same cores
(VLLM_CPU_OMP_THREADS_BIND=0-1). Without it the script says so and compares against pdserve's
plain engine loop (engine.LLM over every line at once, what `pdserve generate` runs) instead.

    python -m benchmarks.batch_vs_vllm [--quick] [--requests N] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
    "they you were their one all we can her has there been if more when will would who so no time river city "
    "light water story music garden winter north morning machine language window mountain letter market"
).split()


def write_input(
    path: Path, n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], words: list[str]
) -> None:
    """Chat lines (vLLM's run-batch serves /v1/chat/completions only) of random words, greedy, ignore_eos."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(*prompt_range)))
            body = {
                "messages": [{"role": "user", "content": text}],
                "max_tokens": rng.randint(*out_range),
                "temperature": 0,
                "ignore_eos": True,
            }
            row = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            f.write(json.dumps(row) + "\n")


def timed(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Wall seconds of `cmd` from start to exit; exits with its log's tail when it fails."""
    start = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        sys.exit(f"{cmd[0]} ... failed (exit {code}):\n{log.read_text()[-4000:]}")
    return seconds


def read_output(path: Path) -> dict[str, tuple[str, int]]:
    """custom_id -> (text, completion tokens) of every answered line."""
    got = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        body = (row.get("response") or {}).get("body") or {}
        if "choices" in body:
            choice = body["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            got[row["custom_id"]] = (text, body["usage"]["completion_tokens"])
    return got


def engine_loop(model_dir: str, inp: str, out: str) -> None:
    """The fallback baseline (a child process): one engine run over every line at once, each with
    its own max_tokens (the loop under engine.LLM and `pdserve generate`)."""
    from pdserve.engine import LLM, SamplingParams

    rows = [json.loads(line) for line in Path(inp).read_text().splitlines()]
    llm = LLM(model_dir, num_threads=2)
    engine, tok = llm.engine, llm.tokenizer
    ids: dict[str, list[int]] = {}
    for r in rows:
        params = SamplingParams(max_tokens=r["body"]["max_tokens"], temperature=0.0, ignore_eos=True)
        prompt = tok.encode_chat(r["body"]["messages"])
        engine.add_request(r["custom_id"], prompt, params)
        ids[r["custom_id"]] = []
    while engine.has_unfinished_requests():
        for step in engine.step():
            ids[step.request_id] += step.new_token_ids
    with open(out, "w") as f:
        for cid, toks in ids.items():
            body = {"choices": [{"text": llm.tokenizer.decode(toks)}], "usage": {"completion_tokens": len(toks)}}
            f.write(json.dumps({"custom_id": cid, "response": {"body": body}}) + "\n")


def has_vllm(python: Path) -> bool:
    return python.is_file() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 short requests instead of 256")
    parser.add_argument("--requests", type=int, default=None, help="number of lines (default 256, 64 with --quick)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--engine-loop", nargs=3, metavar=("MODEL", "IN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_loop:
        engine_loop(*args.engine_loop)
        return

    from benchmarks.common import emit
    from pdserve.engine.builtin import default_model_dir

    model = str(default_model_dir("bench"))
    n = args.requests or (64 if args.quick else 256)
    shape = ((8, 64), (8, 64)) if args.quick else ((8, 384), (16, 256))  # words, output tokens
    vllm_python = Path(args.vllm_python)
    peer = "vllm" if has_vllm(vllm_python) else "engine-loop"
    if peer != "vllm":
        print(
            f"vLLM CPU is not installed at {vllm_python} (scripts/install_vllm_cpu.sh, or pass --vllm-python): "
            "comparing against pdserve's plain engine loop instead",
            flush=True,
        )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        inp = tmp / "in.jsonl"
        write_input(inp, n, *shape, WORDS)
        ours = [sys.executable, "-m", "pdserve.cli", "batch", "-i", str(inp), "--model", model]
        ours += ["--stages", str(args.stages), "--dtype", "float32", "--profile-cache", str(tmp / "profiles")]
        walls, stats = {}, {}
        for run in ("cold", "warm"):
            out = tmp / f"pdserve-{run}.jsonl"
            walls[run] = timed([*ours, "-o", str(out), "--stats", str(tmp / f"{run}.json")], tmp / f"{run}.log")
            stats[run] = json.loads((tmp / f"{run}.json").read_text())
            print(f"pdserve batch ({run} profile cache): {walls[run]:.1f} s end to end; {stats[run]}", flush=True)
        peer_out = tmp / "peer.jsonl"
        if peer == "vllm":
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
            cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.run_batch", "-i", str(inp), "-o", str(peer_out)]
            cmd += [
                "--model",
                model,
                "--dtype",
                "float32",
                "--max-model-len",
                "1024",
                "--max-num-batched-tokens",
                "2048",
            ]
            peer_wall = timed(cmd, tmp / "peer.log", env)
        else:
            cmd = [sys.executable, "-m", "benchmarks.batch_vs_vllm", "--engine-loop", model, str(inp), str(peer_out)]
            peer_wall = timed(cmd, tmp / "peer.log")
        a, b = read_output(tmp / "pdserve-warm.jsonl"), read_output(peer_out)
    tokens, peer_tokens = sum(t for _, t in a.values()), sum(t for _, t in b.values())
    if len(a) != n or len(b) != n:
        sys.exit(f"answered lines: pdserve {len(a)}, {peer} {len(b)} of {n}")
    same = sum(a[c][0] == b[c][0] for c in a)
    tps = {run: tokens / walls[run] for run in walls}
    peer_tps = peer_tokens / peer_wall
    print(
        f"{n} lines: pdserve batch {walls['warm']:.1f} s warm / {walls['cold']:.1f} s cold "
        f"(profile {stats['cold']['profile_seconds']:.1f} s, then {stats['warm']['profile_seconds']:.1f} s cached), "
        f"{peer} {peer_wall:.1f} s; output tok/s {tps['warm']:.1f} / {tps['cold']:.1f} vs {peer_tps:.1f}; "
        f"identical text {same}/{n}"
    )
    emit(
        {
            "metric": "batch_end_to_end_output_tokens_per_s",
            "value": round(tps["warm"], 2),
            "baseline": round(peer_tps, 2),
            "ratio": round(tps["warm"] / peer_tps, 3),
            "target": 1.0,
            "baseline_engine": peer,
            "cold_value": round(tps["cold"], 2),
            "cold_ratio": round(tps["cold"] / peer_tps, 3),
            "wall_s": round(walls["warm"], 1),
            "cold_wall_s": round(walls["cold"], 1),
            "baseline_wall_s": round(peer_wall, 1),
            "profile_s": stats["cold"]["profile_seconds"],
            "bubble_fraction": stats["warm"]["bubble_fraction"],
            "requests": n,
            "stages": args.stages,
            "identical_text": same,
        }
    )


if __name__ == "__main__":  # vLLM's and torch's workers re-import modules: run only as a script
    main()
