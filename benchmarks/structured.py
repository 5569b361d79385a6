"""Structured-output decoding throughput against unconstrained decoding of the same requests.

One engine, the same prompts, seeds and max_tokens twice: free sampling, then every request under
a JSON schema (an object of 80 required integers, longer than max_tokens, so both runs generate
exactly max_tokens tokens per request and the batch shapes are identical; only the grammar masks
differ). Grammars are compiled before the timed run (nodes compile off the step loop; the cold
compile time is reported). The two runs alternate over `--rounds` rounds (which goes first reverses
every round); the median tokens/s of each and the median of the paired per-round ratios are
reported, every round's figures in the JSON.

Target: structured tokens/s >= 0.9 x unconstrained tokens/s (masks must not halve speed).

    python -m benchmarks.structured [--quick] [--model-size bench|tiny] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from benchmarks.common import add_rounds_arg, alternate, emit
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.builtin import default_model_dir
from pdserve.engine.grammar import GrammarSpec, xgrammar_module

SCHEMA = {  # 80 required properties in order: never complete within max_tokens, and no repetition bound
    "type": "object",
    "properties": {f"k{i}": {"type": "integer", "minimum": 0, "maximum": 999} for i in range(80)},
    "required": [f"k{i}" for i in range(80)],
    "additionalProperties": False,
}
TARGET = 0.9


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    """Tokens/s of one run of every request to its end, and the tokens generated."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-size", default="bench", choices=["bench", "tiny"])
    add_rounds_arg(parser)
    args = parser.parse_args()
    num_requests, max_tokens = (16, 48) if args.quick else (32, 128)
    engine = LLMEngine(
        EngineConfig(default_model_dir(args.model_size), num_threads=2, max_num_seqs=64, num_kv_blocks=1024)
    )
    engine.runner.attention.wait_ready()
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(32)] for _ in range(num_requests)]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    xgrammar_module()  # the import (seconds on a loaded machine) is not compilation
    start = time.perf_counter()
    engine.grammars.compile(spec)  # cold: also reads the vocabulary into xgrammar's tables
    first_compile = time.perf_counter() - start
    compile_seconds = engine.grammars.last_compile_seconds
    free = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(num_requests)
    ]
    guided = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured_outputs=spec)
        for i in range(num_requests)
    ]
    run(engine, prompts[:2], free[:2])  # warm-up
    expected = num_requests * max_tokens

    def arm(params: list[SamplingParams]) -> dict:
        tps, tokens = run(engine, prompts, params)
        assert tokens == expected, (tokens, expected)  # same batch shapes in both arms, or the ratio means nothing
        return {"tokens_per_s": round(tps, 1)}

    runs = alternate({"unconstrained": lambda: arm(free), "structured": lambda: arm(guided)}, args.rounds)
    free_tps = round(statistics.median(f["tokens_per_s"] for f in runs.of("unconstrained")), 1)
    guided_tps = round(statistics.median(f["tokens_per_s"] for f in runs.of("structured")), 1)
    ratio = runs.median_ratio("structured", "unconstrained", "tokens_per_s")
    emit(
        {
            "metric": "structured_over_unconstrained_tokens_per_s",
            "value": guided_tps,
            "baseline": free_tps,
            "ratio": ratio,
            "ratio_is": "median of the paired per-round ratios",
            "target": TARGET,
            "pass": ratio is not None and ratio >= TARGET,
            "rounds": runs.rounds,
            "model": args.model_size,
            "requests": num_requests,
            "max_tokens": max_tokens,
            "grammar_compile_ms": round(compile_seconds * 1000, 1),
            "first_compile_with_vocabulary_ms": round(first_compile * 1000, 1),
        }
    )


if __name__ == "__main__":
    main()
