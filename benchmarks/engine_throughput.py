"""Engine throughput on the `bench` model vs Hugging Face `generate` in padded batches.

Workload: 128 requests, prompt lengths uniform in [16, 512], output lengths
uniform in [16, 256] (ignore_eos, greedy, fixed seed) — the variable mix of real
traffic. Both sides use the same dtype and thread count. Measured in one run:

  * pdserve output tokens/s (continuous batching, paged KV);
  * what a user would otherwise do: transformers `generate` in left-padded
    batches of 64, each batch running to its longest request; only useful
    (requested) tokens are counted;
  * the batch-1 decode step time against its bandwidth bound: the bytes the step must read (weights
    and the sequence's KV) / memory-copy bandwidth measured in the same run.

Targets: >= 2x Hugging Face's useful tokens/s; batch-1 decode within 2x of the bound. With a
mixture-of-experts `--arch` (qwen3-moe, mixtral, deepseek-v2, deepseek-v3) the bound counts the
weights a batch-1 step reads: its top-k experts of each sparse layer (and DeepSeek's shared ones),
not all of them; with DeepSeek's latent attention, the KV is the latent.

Rounds: pdserve, transformers and the decode step each run once per round, in an order reversed
every other round, over `--rounds` rounds (default 3); figures are medians over the rounds, ratios
the median of the per-round ratios, and the JSON keeps every round's figures (`rounds`).

    python -m benchmarks.engine_throughput [--arch ARCH] [--dtype float32|bfloat16] [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from benchmarks.common import add_rounds_arg, alternate, emit, median_figures
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.builtin import default_model_dir
from pdserve.engine.kv_pool import kv_bytes_per_token
from pdserve.engine.tiny_model import ARCHS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def workload(n: int, prompt_range: tuple[int, int], out_range: tuple[int, int], vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [
        ([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*out_range))
        for _ in range(n)
    ]


def make_engine(model_dir: Path | str, dtype: str, threads: int, workloads: list[list]) -> LLMEngine:
    """An engine with the settings both peer benchmarks use, its KV pool sized for the largest of
    `workloads` (lists of `(prompt_ids, max_tokens)` pairs) all in flight at once."""
    need = max(sum(len(p) + o for p, o in reqs) // 16 + 2 * len(reqs) for reqs in workloads)
    engine = LLMEngine(
        EngineConfig(
            model_dir,
            dtype=dtype,
            num_threads=threads,
            max_num_seqs=128,
            max_num_batched_tokens=2048,
            num_kv_blocks=need + 64,
        )
    )
    engine.runner.attention.wait_ready()  # a first-use kernel build is not part of the measurement
    return engine


def generate(engine: LLMEngine, reqs: list, tag: str = "", temperature: float = 0.0) -> tuple[float, list[list[int]]]:
    """Add `reqs` as EOS-ignoring requests (ids `tag` + index; greedy, or sampled unseeded at
    `temperature`) and run the engine until all are done: (seconds from the first add to the last
    token, each request's generated ids in order)."""
    start = time.perf_counter()
    for i, (prompt, out) in enumerate(reqs):
        params = SamplingParams(temperature=temperature, max_tokens=out, ignore_eos=True)
        engine.add_request(f"{tag}{i}", prompt, params)
    token_ids: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(reqs))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            token_ids[o.request_id].extend(o.new_token_ids)
    return time.perf_counter() - start, [token_ids[f"{tag}{i}"] for i in range(len(reqs))]


def run_pdserve(model_dir: Path, dtype: str, threads: int, reqs) -> tuple[float, int]:
    seconds, ids = generate(make_engine(model_dir, dtype, threads, [reqs]), reqs)
    return seconds, sum(map(len, ids))


def run_hf(model_dir: Path, dtype: str, threads: int, reqs, batch: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    pad = 0
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(reqs), batch):
        group = reqs[i : i + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
        longest = max(o for _, o in group)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
        useful += sum(o for _, o in group)
    return time.perf_counter() - start, useful


def memcpy_gbps(nbytes: int = 1 << 30) -> float:
    """Bytes copied per second by `copy_` of a 1 GiB buffer (the convention of the machine notes:
    each byte counted once, although a copy both reads and writes it)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm: fault the pages in
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


DECODE_PROMPT = 128


def decode_step_seconds(model_dir: Path, dtype: str, threads: int, steps: int) -> tuple[float, int]:
    """Median batch-1 decode step of a 128-token prompt's continuation, and the bytes that step reads:
    the weights of one token (embedding row aside) and the KV of its median context."""
    engine = LLMEngine(EngineConfig(model_dir, dtype=dtype, num_threads=threads, num_kv_blocks=64))
    engine.runner.attention.wait_ready()
    prompt = list(range(10, 10 + DECODE_PROMPT))
    engine.add_request("b1", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        times.append(_timed(engine.step))
    times.sort()
    cfg, pool = engine.runner.model_config, engine.runner.kv_pool
    kv = (DECODE_PROMPT + steps // 2) * kv_bytes_per_token(cfg, cfg.num_hidden_layers, pool.dtype)
    return times[len(times) // 2], engine.runner.model.weight_bytes(one_token=True) + kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=list(ARCHS))
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="16 shorter requests (< 1 minute a round)")
    add_rounds_arg(parser)
    args = parser.parse_args()
    model_dir = default_model_dir("bench", args.arch)
    from pdserve.engine.tokenizer import Tokenizer

    vocab = Tokenizer(model_dir).vocab_size
    if args.quick:
        reqs, batch, steps = workload(16, (16, 96), (8, 32), vocab), 64, 16
    else:
        reqs, batch, steps = workload(128, (16, 512), (16, 256), vocab), 64, 64

    def ours() -> dict:
        seconds, tokens = run_pdserve(model_dir, args.dtype, args.threads, reqs)
        print(f"pdserve: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s", flush=True)
        return {"tok_s": tokens / seconds, "seconds": seconds}

    def hf() -> dict:
        seconds, tokens = run_hf(model_dir, args.dtype, args.threads, reqs, batch)
        print(f"HF generate (padded batches of {batch}): {tokens} useful tokens in {seconds:.1f} s", flush=True)
        return {"tok_s": tokens / seconds, "seconds": seconds}

    def decode() -> dict:
        step, read_bytes = decode_step_seconds(model_dir, args.dtype, args.threads, steps)
        bw = memcpy_gbps()
        bound = read_bytes / (bw * 1e9)
        print(
            f"batch-1 decode step {step * 1e3:.1f} ms vs bound {bound * 1e3:.1f} ms "
            f"({read_bytes / 1e6:.0f} MB of weights and KV at {bw:.1f} GB/s copied): {step / bound:.2f}x "
            f"(counting a copy's read and write traffic: {2 * step / bound:.2f}x)",
            flush=True,
        )
        return {"step_ms": step * 1e3, "bound_ms": bound * 1e3, "vs_bound": step / bound, "memcpy_gbps": bw}

    ran = alternate({"pdserve": ours, "hf": hf, "decode": decode}, args.rounds)
    mine, theirs, dec = (median_figures(ran.of(arm)) for arm in ("pdserve", "hf", "decode"))
    ratios = ran.ratios("pdserve", "hf", "tok_s")
    emit(
        {
            "metric": "output_tokens_per_s",
            "value": round(mine["tok_s"], 2),
            "baseline": round(theirs["tok_s"], 2),
            "ratio": ran.median_ratio("pdserve", "hf", "tok_s"),
            "ratio_per_round": [round(r, 3) for r in ratios],
            "target": 2.0,
            "arch": args.arch,
            "dtype": args.dtype,
            "threads": args.threads,
            "requests": len(reqs),
            "decode_step_ms": round(dec["step_ms"], 2),
            "decode_bound_ms": round(dec["bound_ms"], 2),
            "decode_step_vs_bound": round(dec["vs_bound"], 3),
            "decode_target": 2.0,
            "memcpy_gbps": round(dec["memcpy_gbps"], 2),
            "decode_step_vs_read_write_bound": round(2 * dec["vs_bound"], 3),
            "rounds": ran.rounds,
        }
    )


if __name__ == "__main__":
    main()
