"""GPU decode and prefill against the device's limits, with decode CUDA graphs on and off.

A Llama-3-8B-shaped model (32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocab
128256) with random bf16 weights is made on the device (no checkpoint is read: the weights are
drawn where they will live). On it, through `ModelRunner.run`, the engine's own step:

- decode at batch 1 and batch 64 (each sequence at --context tokens), graphs on (the default) and
  off (`--enforce-eager`'s path, the same runner), the two arms alternating over --rounds rounds;
- prefill of one 4096-token prompt.

Bounds, both read in the same run:
- decode: bytes a step must read (every weight a step reads, `LlamaModel.weight_bytes`, plus the KV
  of every sequence's context) / the device's memory bandwidth, measured as a device-to-device copy
  (bytes read + written per second). The ratio step time / bound is the figure (target <= 1.3 at
  batch 1, <= 1.5 at batch 64);
- prefill: the FLOPs of the step (each layer's GEMMs at 4096 rows, causal attention, the LM head on
  the last row) / time, against the bf16 dense peak of the datasheet (--peak-tflops, default 989.4,
  H100/H200 SXM) and against a measured 8192^3 bf16 matmul (target >= 50% of the datasheet's).

Needs a CUDA device with ~40 GiB free. The last stdout line is the JSON result (metric: the batch-1
ratio with graphs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import add_rounds_arg, alternate, emit, median_figures

LLAMA3_8B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
BLOCK = 16
PROMPT = 4096


def random_weights(cfg: dict, device: torch.device):
    """A `load_tensors` stand-in: the checkpoint's tensors, by their Hugging Face names, drawn on the
    device (std 0.02, norms 1)."""

    def load(model_dir, config, layer_range, dtype, dev, shard=None):
        h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
        hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        gen = torch.Generator(device=device).manual_seed(0)

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

        t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": torch.ones(h, dtype=dtype, device=device)}
        t["lm_head.weight"] = w(v, h)
        for n in range(*layer_range):
            p = f"model.layers.{n}."
            t[p + "self_attn.q_proj.weight"] = w(hq * d, h)
            t[p + "self_attn.k_proj.weight"] = w(hkv * d, h)
            t[p + "self_attn.v_proj.weight"] = w(hkv * d, h)
            t[p + "self_attn.o_proj.weight"] = w(h, hq * d)
            t[p + "mlp.gate_proj.weight"] = w(i, h)
            t[p + "mlp.up_proj.weight"] = w(i, h)
            t[p + "mlp.down_proj.weight"] = w(h, i)
            t[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
            t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype, device=device)
        return t

    return load


def build_runner(model_dir: Path, device: torch.device, num_blocks: int, layers: int):
    import pdserve.engine.model_runner as mr

    cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
    (model_dir / "config.json").write_text(json.dumps(cfg))
    real = mr.load_tensors
    mr.load_tensors = random_weights(cfg, device)
    try:
        return mr.ModelRunner(
            model_dir,
            dtype="bfloat16",
            device=str(device),
            attention_backend="torch",
            block_size=BLOCK,
            num_kv_blocks=num_blocks,
            max_model_len=8192,
            max_num_seqs=256,
        )
    finally:
        mr.load_tensors = real


def timed(fn, steps: int) -> list[float]:
    """Seconds of each of `steps` calls, by CUDA events around each (after 3 untimed)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def copy_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Bytes per second of a device-to-device copy, read + written (the median of 10)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = statistics.median(timed(lambda: dst.copy_(src), 10))
    return 2 * nbytes / t


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    t = statistics.median(timed(lambda: a @ b, 10))
    return 2 * n**3 / t / 1e12


def graph_time(work, steps: int) -> float:
    """Median seconds of `work` replayed from a CUDA graph (its launches do not count)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return statistics.median(timed(graph.replay, steps))


def breakdown(runner, batches: dict, bandwidth: float, steps: int) -> dict:
    """Where a decode step's time goes: the GEMMs alone and the attention alone, each replayed from
    a graph, as achieved bandwidth; and the attention kernel's launch shapes."""
    from pdserve.engine.attention import triton_decode
    from pdserve.engine.attention.torch_backend import decode_tables

    model, out = runner.model, {}
    linears = [lin for layer in model.layers for lin in layer.linears()] + [model.lm_head]
    for n, batch in batches.items():
        x = {
            lin.weight.shape[1]: torch.randn(n, lin.weight.shape[1], device="cuda", dtype=runner.dtype)
            for lin in linears
        }
        t = graph_time(lambda: [lin(x[lin.weight.shape[1]]) for lin in linears], steps)
        out[f"gemms_b{n}_ms"] = t * 1e3
        out[f"gemms_b{n}_TBps"] = sum(lin.nbytes for lin in linears) / t / 1e12
        table, ctx = decode_tables(batch, BLOCK, torch.device("cuda"))
        cfg = runner.model_config
        q = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, device="cuda", dtype=runner.dtype)
        kv_bytes = n * batch.context_lens[0] * runner.kv_pool.block_bytes * runner.kv_pool.num_layers / BLOCK
        for tile, warps in ((64, 4), (128, 4), (64, 8), (32, 2), (128, 8)):

            def attend(tile=tile, warps=warps):
                for layer in range(runner.kv_pool.num_layers):
                    kv = runner.kv_pool.layer(layer)
                    triton_decode.paged_decode(
                        q, kv[:, 0], kv[:, 1], table, ctx, cfg.head_dim**-0.5, tile=tile, num_warps=warps
                    )

            t = graph_time(attend, steps)
            out[f"attention_b{n}_tile{tile}_warps{warps}_ms"] = t * 1e3
            out[f"attention_b{n}_tile{tile}_warps{warps}_TBps"] = kv_bytes / t / 1e12
    out["copy_TBps"] = bandwidth / 1e12
    return {k: round(v, 3) for k, v in out.items()}


def decode_batch(batch_size: int, context: int, first_block: int):
    from pdserve.engine.forward_batch import ForwardBatch

    pages = (context + BLOCK - 1) // BLOCK
    tables = [list(range(first_block + s * pages, first_block + (s + 1) * pages)) for s in range(batch_size)]
    return ForwardBatch(
        [f"s{s}" for s in range(batch_size)],
        [1000 + s for s in range(batch_size)],
        [1] * batch_size,
        [context] * batch_size,
        tables,
        [True] * batch_size,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer timed steps (minutes less)")
    p.add_argument("--context", type=int, default=1024, help="tokens of context of every decoding sequence")
    p.add_argument("--layers", type=int, default=32, help="decoder layers (32: Llama-3-8B)")
    p.add_argument("--peak-tflops", type=float, default=989.4, help="the datasheet's dense bf16 TFLOP/s")
    add_rounds_arg(p)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("error: gpu_decode needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    steps = 20 if args.quick else 100
    big = 64
    pages = (args.context + BLOCK - 1) // BLOCK
    num_blocks = big * pages + PROMPT // BLOCK + 8
    with tempfile.TemporaryDirectory() as tmp:
        runner = build_runner(Path(tmp), dev, num_blocks, args.layers)
    runner.kv_pool.tensor.normal_(0, 1)
    graphs = runner.graphs
    assert graphs is not None and graphs.captured, "the runner captured no decode graphs"
    weights = runner.model.weight_bytes(one_token=True)
    kv_token = runner.kv_pool.block_bytes * runner.kv_pool.num_layers // BLOCK  # every layer's K and V
    bandwidth = copy_bandwidth(dev)
    measured_tflops = matmul_tflops(dev)
    batches = {1: decode_batch(1, args.context, 0), big: decode_batch(big, args.context, 0)}

    def decode_arm(use_graphs: bool):
        def run() -> dict:
            runner.graphs = graphs if use_graphs else None
            out = {}
            for n, batch in batches.items():
                t = statistics.median(timed(lambda: runner.run(batch), steps))
                bound = (weights + n * args.context * kv_token) / bandwidth
                out[f"b{n}_ms"] = t * 1e3
                out[f"b{n}_bound_ms"] = bound * 1e3
                out[f"b{n}_vs_bound"] = t / bound
            runner.graphs = graphs
            return out

        return run

    rounds = alternate({"graphs": decode_arm(True), "eager": decode_arm(False)}, args.rounds)
    g, e = median_figures(rounds.of("graphs")), median_figures(rounds.of("eager"))
    assert graphs.replays > 0, "no decode step replayed a graph"

    parts = breakdown(runner, batches, bandwidth, steps)
    from pdserve.engine.forward_batch import ForwardBatch

    rng = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA3_8B["vocab_size"], (PROMPT,), generator=rng).tolist()
    first = big * pages
    prefill = ForwardBatch(["p"], ids, [PROMPT], [PROMPT], [list(range(first, first + PROMPT // BLOCK))], [True])
    prefill_s = statistics.median(timed(lambda: runner.run(prefill), 5 if args.quick else 20))
    h, i, L = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"], args.layers
    hq, hkv, d = LLAMA3_8B["num_attention_heads"], LLAMA3_8B["num_key_value_heads"], LLAMA3_8B["head_dim"]
    per_token_layer = 2 * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)
    attention = 2 * 2 * hq * d * PROMPT * (PROMPT + 1) / 2  # QK^T and PV over the causal half, per layer
    flops = L * (PROMPT * per_token_layer + attention) + 2 * h * LLAMA3_8B["vocab_size"]
    prefill_tflops = flops / prefill_s / 1e12
    result = {
        "metric": "decode step at batch 1 with CUDA graphs / (weight bytes / measured HBM bandwidth)",
        "value": round(g["b1_ms"], 3),
        "baseline": round(g["b1_bound_ms"], 3),
        "ratio": round(g["b1_vs_bound"], 3),
        "target": 1.3,
        "unit": "ms",
        "model": f"Llama-3-8B shape, {args.layers} layers, random bf16 weights made on the device",
        "context_tokens": args.context,
        "weight_bytes_per_step": weights,
        "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
        "matmul_bf16_TFLOPs_measured": round(measured_tflops, 1),
        "graphs": {k: round(v, 3) for k, v in g.items()},
        "eager": {k: round(v, 3) for k, v in e.items()},
        "peer": "none: the baseline is the device's bandwidth bound; `eager` is this runner with its "
        "CUDA graphs off (--enforce-eager), an ablation of pdserve's own path, not a peer run outside its default",
        "graphs_speedup_b1": round(e["b1_ms"] / g["b1_ms"], 3),
        "graphs_speedup_b64": round(e[f"b{big}_ms"] / g[f"b{big}_ms"], 3),
        "b64_target": 1.5,
        "prefill_4k_ms": round(prefill_s * 1e3, 2),
        "prefill_4k_TFLOPs": round(prefill_tflops, 1),
        "prefill_4k_of_datasheet_peak": round(prefill_tflops / args.peak_tflops, 3),
        "prefill_4k_of_measured_matmul": round(prefill_tflops / measured_tflops, 3),
        "prefill_target_of_peak": 0.5,
        "breakdown": parts,
        "per_round": rounds.rounds,
        "graph_replays": graphs.replays,
    }
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
