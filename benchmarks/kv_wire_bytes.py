"""KV bytes on the wire per prompt token, prefill -> decode: DeepSeek's latent against multi-head K/V.

    python -m benchmarks.kv_wire_bytes [--quick]

One prefill and one decode node process per arm (tcp CacheStore, local prefill off: every prompt is
prefilled on the prefill node and its KV streamed into the decode node), fresh prompts (no prefix
hits). The decode node's `pdserve_cachestore_bytes_total{side="recv"}` over the prompts' tokens is
the figure. Arms, all the bench size (hidden 768, 12 layers, 12 query heads, float32):

  * `mla`: `--arch deepseek-v3` (a latent of 512 + 64 values per token and layer);
  * `mha`: the Llama bench model with all 12 heads as KV heads (head dim 64): multi-head K/V of the
    same width, what MLA replaces;
  * `gqa`: the Llama bench model as built (4 KV heads), for reference.

`ratio` = mha bytes / mla bytes; `target` is the ratio the two geometries imply (2 * 12 * 64 / 576):
the wire should carry exactly the pool's bytes, nothing expanded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import urllib.request
from pathlib import Path

from benchmarks.cluster_procs import NodeProc
from benchmarks.common import emit, machine

SECRET = "bench"


def mha_model(out: Path) -> Path:
    """The Llama bench checkpoint with num_key_value_heads = num_attention_heads (new random k/v)."""
    import torch
    from safetensors.torch import load_file, save_file

    from pdserve.engine.builtin import default_model_dir

    if (out / "model.safetensors").is_file():
        return out
    shutil.copytree(default_model_dir("bench"), out, dirs_exist_ok=True)
    raw = json.loads((out / "config.json").read_text())
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    raw["num_key_value_heads"] = heads
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    tensors = load_file(str(out / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("k_proj.weight", "v_proj.weight"))]:
        tensors[name] = torch.randn(heads * raw["head_dim"], hidden, generator=g) * hidden**-0.5
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def received_bytes(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("pdserve_cachestore_bytes_total{") and 'side="recv"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def generate(decode: str, prefill: str, rid: str, prompt: list[int]) -> None:
    import grpc

    from pdserve.node_runtime.auth import cluster_metadata
    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    req = decode_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        params=common_pb2.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        prefill_addresses=[prefill],
    )
    async with grpc.aio.insecure_channel(decode) as ch:
        async for _ in decode_pb2_grpc.DecodeStub(ch).Generate(req, metadata=cluster_metadata(SECRET), timeout=600):
            pass


def bytes_per_token(model: str, prompts: list[list[int]]) -> float:
    """Decode-side received KV bytes over the prompts' tokens, one arm's node pair."""
    common = ["--port", "0", "--model", model, "--cluster-secret", SECRET, "--num-threads", "1"]
    metrics = free_port()
    prefill = NodeProc("prefill", common)
    try:
        decode = NodeProc("decode", common + ["--local-prefill-max-tokens", "0", "--metrics-port", str(metrics)])
        try:
            before = received_bytes(metrics)
            for i, prompt in enumerate(prompts):
                asyncio.run(generate(decode.address, prefill.address, f"r{i}", prompt))
            return (received_bytes(metrics) - before) / sum(map(len, prompts))
        finally:
            decode.stop()
    finally:
        prefill.stop()


def main() -> None:
    from pdserve.engine.builtin import cache_root, default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts of 256 tokens per arm")
    args = parser.parse_args()
    n, length = (4, 256) if args.quick else (8, 1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1500) for _ in range(length)] for _ in range(n)]
    arms = {
        "mla": str(default_model_dir("bench", "deepseek-v3")),
        "mha": str(mha_model(cache_root() / "models" / "bench-llama-mha")),
        "gqa": str(default_model_dir("bench")),
    }
    per_token = {name: bytes_per_token(model, prompts) for name, model in arms.items()}
    for name, value in per_token.items():
        print(f"{name}: {value:.0f} KV bytes on the wire per prompt token", flush=True)
    emit(
        {
            "metric": "kv_wire_bytes_per_prompt_token_mha_over_mla",
            "value": round(per_token["mla"]),
            "baseline": round(per_token["mha"]),
            "ratio": round(per_token["mha"] / per_token["mla"], 3),
            "target": round(2 * 12 * 64 / (512 + 64), 3),
            "gqa_bytes_per_token": round(per_token["gqa"]),
            "prompts": n,
            "prompt_tokens": length,
            "dtype": "float32",
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
