"""MLA decode attention on CPU: the latent read in place against the same attention over expanded K/V.

    python -m benchmarks.mla_attention [--dtype bfloat16|float32] [--quick]

DeepSeek-V2-Lite's attention geometry (16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128),
one decode token for each of `--batch` sequences of `--ctx` keys, over `--layers` layer pools (blocks
scattered, so the KV comes from memory as in an engine step), 2 threads:

  * latent (what pdserve runs, engine.mla): absorb W_UK into each head's query, one call of the
    `cpu_paged` op over the one-plane pool of 576-value latents (all 16 heads read the same latent),
    then W_UV on the output's first 512 values;
  * expanded (what a cache of per-head K/V reads, as transformers keeps it): the same op over a
    two-plane pool of 16 heads of K [W_UK c, k_pe] (192) and V = W_UV c, the V rows zero-padded from
    128 to 192 because the op takes one head size (named in the JSON: the padding adds 1/5 to the
    expanded pool's bytes, so `ratio_unpadded_bytes` scales that arm's time down by it as a bound).

Both arms' outputs are compared (max abs difference after W_UV): the same attention. Arms alternate
over the rounds; the JSON line keeps each round's figures and reports the medians. `ratio` =
expanded time / latent time (above 1: the latent is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import emit, machine
from pdserve.engine.kernels.cpu_build import load_paged_attention_op

HQ, LORA, NOPE, ROPE, V, BLOCK = 16, 512, 128, 64, 128, 16
QK = NOPE + ROPE


def build(batch: int, ctx: int, layers: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """Random latents and up-projections, the two pools (latent, expanded) holding the same keys, and
    the page tables (scattered)."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-ctx // BLOCK)
    n = batch * pages
    w_uk = torch.randn(HQ, NOPE, LORA, generator=g) * LORA**-0.5
    w_uv = torch.randn(HQ, V, LORA, generator=g) * LORA**-0.5
    latent_pools, expanded_pools = [], []
    for _ in range(layers):
        lat = torch.randn(n, 1, 1, BLOCK, LORA + ROPE, generator=g)
        c, k_pe = lat[..., :LORA], lat[..., LORA:]
        k = torch.cat([torch.einsum("nobl,hdl->nhbd", c[:, 0], w_uk), k_pe[:, 0].expand(-1, HQ, -1, -1)], -1)
        v = torch.nn.functional.pad(torch.einsum("nobl,hdl->nhbd", c[:, 0], w_uv), (0, QK - V))
        latent_pools.append(lat.to(dtype).contiguous())
        expanded_pools.append(torch.stack([k, v], dim=1).to(dtype).contiguous())
    perm = torch.randperm(n, generator=g).to(torch.int32)
    table = perm.view(batch, pages).contiguous()
    q = torch.randn(batch, HQ, QK, generator=g)
    return {
        "latent": latent_pools,
        "expanded": expanded_pools,
        "table": table,
        "starts": torch.arange(batch + 1, dtype=torch.int32),
        "ctx": torch.full((batch,), ctx, dtype=torch.int32),
        "q": q.to(dtype),
        "w_uk": w_uk.to(dtype),
        "w_uv_t": w_uv.transpose(1, 2).contiguous().to(dtype),
    }


def latent_step(op, s: dict, scale: float) -> list[torch.Tensor]:
    """Every layer's decode attention the way engine.mla runs it: absorb, attend the latent, project."""
    outs = []
    q_nope, q_pe = s["q"].split([NOPE, ROPE], dim=-1)
    for pool in s["latent"]:
        q_lat = torch.bmm(q_nope.transpose(0, 1).contiguous(), s["w_uk"]).transpose(0, 1)
        query = torch.cat([q_lat, q_pe], dim=-1)
        out = op(query, pool, s["table"], s["starts"], s["ctx"], scale, 0)
        outs.append(torch.bmm(out[..., :LORA].transpose(0, 1), s["w_uv_t"]).transpose(0, 1))
    return outs


def expanded_step(op, s: dict, scale: float) -> list[torch.Tensor]:
    """Every layer's decode attention over per-head K/V (V padded to the key size)."""
    return [op(s["q"], pool, s["table"], s["starts"], s["ctx"], scale, 0)[..., :V] for pool in s["expanded"]]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="context 512, 3 rounds (seconds)")
    args = parser.parse_args()
    if args.quick:
        args.ctx, args.rounds = 512, 3
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    op = load_paged_attention_op()
    if op is None:
        raise SystemExit("the cpu_paged op did not build here (no compiler?): nothing to measure")
    s = build(args.batch, args.ctx, args.layers, dtype)
    scale = QK**-0.5
    with torch.inference_mode():
        diff = max(
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(latent_step(op, s, scale), expanded_step(op, s, scale))
        )
        rounds = []
        for _ in range(args.rounds):  # alternate the arms, round by round
            lat = timed(lambda: latent_step(op, s, scale)) / args.layers
            exp = timed(lambda: expanded_step(op, s, scale)) / args.layers
            rounds.append({"latent_ms": round(lat * 1e3, 3), "expanded_ms": round(exp * 1e3, 3)})
    lat_ms = statistics.median(r["latent_ms"] for r in rounds)
    exp_ms = statistics.median(r["expanded_ms"] for r in rounds)
    item = torch.empty((), dtype=dtype).element_size()
    latent_bytes = args.batch * args.ctx * (LORA + ROPE) * item
    expanded_bytes = args.batch * args.ctx * HQ * (QK + V) * item  # unpadded per-head K and V
    print(
        f"per layer, {args.batch} seqs x {args.ctx} keys, {args.dtype}: latent {lat_ms:.2f} ms "
        f"({latent_bytes / 1e6:.1f} MB of KV), expanded {exp_ms:.2f} ms ({expanded_bytes / 1e6:.1f} MB unpadded); "
        f"max abs diff {diff:.2e}"
    )
    emit(
        {
            "metric": "mla_decode_attention_expanded_over_latent",
            "value": lat_ms,
            "baseline": exp_ms,
            "ratio": round(exp_ms / lat_ms, 3),
            "target": 1.0,
            "ratio_unpadded_bytes": round(exp_ms * (QK + V) / (2 * QK) / lat_ms, 3),
            "unit": "ms per layer",
            "dtype": args.dtype,
            "batch": args.batch,
            "ctx": args.ctx,
            "layers": args.layers,
            "threads": args.threads,
            "latent_kv_mb_per_layer": round(latent_bytes / 1e6, 2),
            "expanded_kv_mb_per_layer": round(expanded_bytes / 1e6, 2),
            "expanded_v_padded_to": QK,
            "max_abs_diff": diff,
            "rounds": rounds,
            "machine": machine(),
        }
    )


if __name__ == "__main__":
    main()
