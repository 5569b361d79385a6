"""The one-plane KV geometry of DeepSeek's latent attention (MLA): the pool stores one latent per token
and layer ([L, N, 1, 1, B, D]), sized and named as such, and every attention backend reads it as both
the key and the value (Hq query heads over one KV head: MQA with V = K)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pdserve.engine.attention import backend_for_planes, make_backend
from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.attention.cpu_paged_backend import CHUNK_SDPA_MIN_TOKENS
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_namespace import kv_compatibility
from pdserve.engine.kv_pool import KVPool, kv_bytes_per_token
from pdserve.engine.kv_sizing import default_cpu_kv_bytes
from pdserve.engine.model_config import MlaConfig, ModelConfig
from pdserve.engine.tiny_model import SIZES
from tests.engine.paged_reference import BF16_ATOL

CPU = torch.device("cpu")


def mla_config(kv_lora_rank: int = 32, rope: int = 16, layers: int = 3) -> ModelConfig:
    """A tiny config with MLA's KV geometry: one KV head of kv_lora_rank + rope values."""
    base = ModelConfig.from_dict({**SIZES["tiny"], "architectures": ["LlamaForCausalLM"], "vocab_size": 256})
    mla = MlaConfig(
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope,
        v_head_dim=16,
        rope_interleave=False,
        softmax_scale=(16 + rope) ** -0.5,
    )
    return dataclasses.replace(base, mla=mla, num_key_value_heads=1, head_dim=mla.latent_dim, num_hidden_layers=layers)


def test_the_pool_stores_one_latent_plane():
    cfg = mla_config()
    assert cfg.kv_planes == 1 and cfg.head_dim == 48
    pool = KVPool(cfg, 3, 16, torch.bfloat16, CPU, num_blocks=10)
    assert pool.tensor.shape == (3, 10, 1, 1, 16, 48) and pool.planes == 1
    assert pool.layer(0).shape == (10, 1, 1, 16, 48)
    assert pool.block_bytes == 16 * 48 * 2  # block_size x latent x bf16: one latent, no K/V copies
    with pytest.raises(ValueError, match="is not a contiguous"):  # a K/V-shaped tensor is not this pool
        KVPool(cfg, 3, 16, torch.bfloat16, CPU, tensor=torch.zeros(3, 10, 2, 1, 16, 48, dtype=torch.bfloat16))
    given = torch.zeros(3, 10, 1, 1, 16, 48, dtype=torch.bfloat16)
    assert KVPool(cfg, 3, 16, torch.bfloat16, CPU, tensor=given).tensor is given


def test_bytes_per_token_and_budget_are_half_a_kv_pair_of_the_same_width():
    mla = mla_config(kv_lora_rank=512, rope=64, layers=4)  # DeepSeek's 576-wide latent
    pair = dataclasses.replace(mla, mla=None)  # the same 1 head x 576, as K and V
    assert kv_bytes_per_token(mla, 4, torch.bfloat16) == 576 * 2 * 4
    assert 2 * kv_bytes_per_token(mla, 4, torch.bfloat16) == kv_bytes_per_token(pair, 4, torch.bfloat16)
    budget = 64 * 576 * 2 * 4 * 2  # 64 blocks of 2 tokens of the latent, 32 of the pair
    assert KVPool(mla, 4, 2, torch.bfloat16, CPU, budget_bytes=budget).num_blocks == 64
    assert KVPool(pair, 4, 2, torch.bfloat16, CPU, budget_bytes=budget).num_blocks == 32
    per_token = kv_bytes_per_token(mla, 4, torch.bfloat16)  # the default CPU budget caps at full sequences
    assert default_cpu_kv_bytes(per_token, 2, 100, 1 << 40) == per_token * 200


def test_the_compatibility_string_names_the_planes():
    mla = mla_config()
    pair = dataclasses.replace(mla, mla=None)
    strings = [kv_compatibility(c, KVPool(c, 3, 16, torch.float32, CPU, num_blocks=2)) for c in (mla, pair)]
    assert strings[0].endswith(";planes=1") and "planes" not in strings[1]
    assert strings[0] != strings[1]


def test_a_shared_pipeline_pool_has_the_models_planes():
    from pdserve.tdpipe.runtime import shared_kv

    assert shared_kv._shape(mla_config(), 7, 16) == (3, 7, 1, 1, 16, 48)


def test_flashinfer_gives_way_to_torch_for_a_latent_pool():
    assert backend_for_planes("flashinfer", 1) == "torch"
    assert backend_for_planes("flashinfer", 2) == "flashinfer"
    assert backend_for_planes("cpu_paged", 1) == "cpu_paged"


def test_the_stage_split_weighs_mla_projections():
    from pdserve.tdpipe.runtime.stage_split import attention_weights

    cfg = mla_config(kv_lora_rank=32, rope=16)  # hidden 128, 4 heads; nope 16, v 16
    q = 128 * 4 * (16 + 16)
    kv = 128 * 48 + 32 * 4 * (16 + 16)
    assert attention_weights(cfg) == q + kv + 4 * 16 * 128


# The backends on one latent plane against plain MQA with V = K (float64).


def _mqa_reference(q: torch.Tensor, latents: list[torch.Tensor], q_lens: list[int], scale: float) -> torch.Tensor:
    """Each sequence's queries (its last q_len positions) over its latents [ctx, D], causal."""
    out, t = [], 0
    for lat, q_len in zip(latents, q_lens):
        ctx, lat = lat.shape[0], lat.double()
        for j in range(q_len):
            keys = lat[: ctx - q_len + j + 1]
            p = (q[t].double() @ keys.T * scale).softmax(-1)  # [Hq, keys]
            out.append(p @ keys)
            t += 1
    return torch.stack(out)


def _step(q_lens: list[int], ctxs: list[int], hq: int, d: int, dtype: torch.dtype, seed: int):
    """A pool layer holding each sequence's cached latents, this step's queries and new latents, the
    metadata, and every sequence's full latent history (the reference's keys and values)."""
    g = torch.Generator().manual_seed(seed)
    bs, num_blocks = 16, 48
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    pool = torch.zeros(num_blocks, 1, 1, bs, d, dtype=dtype)
    tables, latents, new = [], [], []
    for q_len, ctx in zip(q_lens, ctxs):
        table = [free.pop() for _ in range(-(-ctx // bs))]
        lat = torch.randn(ctx, d, generator=g).to(dtype)
        for pos in range(ctx - q_len):  # the cached prefix is in the pool already
            pool[table[pos // bs], 0, 0, pos % bs] = lat[pos]
        tables.append(table)
        latents.append(lat)
        new.append(lat[ctx - q_len :])
    k = torch.cat(new)[:, None, :]  # [T, 1, D]: the model passes this one tensor as k and v
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    batch = ForwardBatch(
        [f"s{i}" for i in range(len(q_lens))], [1] * len(k), q_lens, ctxs, tables, [True] * len(q_lens)
    )
    return pool, q, k, AttentionMetadata.build(batch, bs, CPU), latents


def _backend(name: str):
    backend = make_backend(name)
    if name == "cpu_paged":
        backend.wait_ready()
        assert backend.uses_kernel, "this machine has a C++ compiler: the ops must build"
    return backend


MIXED = (
    [1, 5, CHUNK_SDPA_MIN_TOKENS + 4, 24, 1],  # decode, short chunk, long chunk, fresh prompt, decode
    [33, 37, 50, 24, 17],
)
DECODE = ([1] * 6, [1, 15, 16, 17, 40, 95])


@pytest.mark.parametrize("backend_name", ["torch", "cpu_paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [48, 96, 576])
@pytest.mark.parametrize("kind", ["mixed", "decode"])
def test_backends_attend_over_the_latent_as_mqa(backend_name, dtype, d, kind):
    """Decode-only steps and mixed ones (decode tokens, chunks after a cached prefix short and long, a
    fresh prompt): each path of each backend matches MQA over the latent with V = K, and the pool
    afterwards holds every latent once, in plane 0."""
    q_lens, ctxs = MIXED if kind == "mixed" else DECODE
    pool, q, k, meta, latents = _step(q_lens, ctxs, 8, d, dtype, seed=d)
    scale = d**-0.5
    got = _backend(backend_name).forward(q, k, k, pool, meta, scale)
    assert got.shape == (len(k), 8, d) and got.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else BF16_ATOL
    torch.testing.assert_close(got.double(), _mqa_reference(q, latents, q_lens, scale), atol=atol, rtol=0)
    for lat, table in zip(latents, meta.batch.block_tables):
        stored = pool[table, 0, 0].reshape(-1, d)[: lat.shape[0]]
        assert torch.equal(stored, lat)


def test_torch_store_writes_only_plane_zero():
    """The torch path's scatter (all backends' on CUDA) leaves a one-plane layer's single plane with k."""
    from pdserve.engine.attention.base import kv_pages, store_kv

    pool, _, k, meta, _ = _step([3], [3], 8, 48, torch.float32, seed=1)
    store_kv(pool, k, torch.full_like(k, 7.0), meta)
    assert torch.equal(pool[meta.batch.block_tables[0][0], 0, 0, :3], k[:, 0])
    keys, values = kv_pages(pool)
    assert keys is values
