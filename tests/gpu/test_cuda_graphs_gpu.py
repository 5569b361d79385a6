"""Decode CUDA graphs on a GPU (engine.cuda_graphs): replayed steps equal eager ones, the graphs'
memory comes out of --gpu-memory-utilization, and the compiled Triton decode kernel equals the
gather + SDPA reference."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention import triton_decode
from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.attention.torch_backend import TorchAttention, decode_tables
from pdserve.engine.forward_batch import ForwardBatch
from tests.gpu.helpers import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1700) for _ in range(rng.randrange(3, 90))] for _ in range(n)]


def _llm(model_dir, dtype: str, eager: bool, **kw) -> LLM:
    options = dict(num_kv_blocks=512, block_size=16, max_num_batched_tokens=256)
    options.update(kw)
    return LLM(model_dir, device="cuda", dtype=dtype, attention_backend="torch", enforce_eager=eager, **options)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_equals_eager_decode(tiny_model_dir, dtype):
    """Greedy outputs and their logprobs are the same with and without graphs, over batches that
    fall on a captured size and between two (padded)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompts = _prompts(13, seed=3)  # 13 sequences decode as one batch, padded to the 16 captured
    results = {}
    for eager in (True, False):
        llm = _llm(tiny_model_dir, dtype, eager)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        outs = llm.generate(prompts, params) + llm.generate(prompts[:4], params) + llm.generate(prompts[:1], params)
        if graphs is not None:
            assert graphs.replays > 0
        llm.engine.check_integrity()
        results[eager] = [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
        del llm
    atol = 1e-4 if dtype == "float32" else 0.05
    for (eager_ids, eager_lp), (graph_ids, graph_lp) in zip(results[True], results[False]):
        if dtype == "float32":
            assert graph_ids == eager_ids
        n = next((i for i, (a, b) in enumerate(zip(eager_ids, graph_ids)) if a != b), len(eager_ids))
        torch.testing.assert_close(torch.tensor(graph_lp[:n]), torch.tensor(eager_lp[:n]), atol=atol, rtol=0)


def test_graph_memory_comes_out_of_the_utilization_share(tiny_model_dir):
    """Profiled at the same --gpu-memory-utilization, the graphs' measured bytes are taken from the
    KV pool: the pool with graphs is smaller by about that much."""
    sizes = {}
    for eager in (True, False):
        llm = LLM(
            tiny_model_dir,
            device="cuda",
            dtype="bfloat16",
            attention_backend="torch",
            gpu_memory_utilization=0.3,
            enforce_eager=eager,
            max_num_seqs=256,
        )
        pool = llm.engine.runner.kv_pool
        sizes[eager] = pool.num_blocks * pool.block_bytes * pool.num_layers
        if not eager:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.captured
        del llm
    assert sizes[False] < sizes[True]
    assert sizes[True] - sizes[False] < 2 * 1024**3  # the tiny model's graphs are far smaller than that


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (20, False), (None, True)])
def test_compiled_kernel_equals_the_gather_decode(dtype, window, with_sinks):
    assert triton_decode.available()
    rng = random.Random(0)
    hq, hkv, d, page = 32, 8, 128, 16
    ctx = [rng.randrange(1, 700) for _ in range(37)]
    n_blocks = sum((c + page - 1) // page for c in ctx) + 1
    order = list(range(n_blocks))
    rng.shuffle(order)
    tables, used = [], 0
    for c in ctx:
        n = (c + page - 1) // page
        tables.append(order[used : used + n])
        used += n
    kv = torch.randn(n_blocks, 2, hkv, page, d, device="cuda").to(dtype)
    q = torch.randn(len(ctx), hq, d, device="cuda").to(dtype)
    sinks = torch.randn(hq, device="cuda") if with_sinks else None
    batch = ForwardBatch(
        [str(i) for i in range(len(ctx))], [0] * len(ctx), [1] * len(ctx), ctx, tables, [True] * len(ctx)
    )
    table, ctx_t = decode_tables(batch, page, q.device)
    got = triton_decode.paged_decode(q, kv[:, 0], kv[:, 1], table, ctx_t, d**-0.5, window, sinks)
    want = _gather_reference(q.float(), kv.float(), batch, page, window, sinks)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def _gather_reference(q, kv, batch, page, window, sinks):
    """The torch backend's gather + SDPA decode, run on CPU (on CUDA the backend takes the kernel)."""
    cpu = TorchAttention()
    meta = AttentionMetadata.build(batch, page, torch.device("cpu"))
    out = cpu._decode(
        q.cpu(),
        kv[:, 0].cpu(),
        kv[:, 1].cpu(),
        meta,
        q.shape[-1] ** -0.5,
        window,
        sinks.cpu() if sinks is not None else None,
    )
    return out.to(q.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_ops_round_as_the_eager_ops(dtype):
    """Compiled, the fused ops round where the eager chain does: the residual stream bit for bit;
    the norm (its mean summed in another order) and SiLU (Triton's exp) within two ulps; the
    rotation within one ulp of its operands (seen on an H200, 2026-11-30: 1.5% of the elements took
    a product rounded the other way, which shows large relative to a sum that nearly cancels)."""
    from pdserve.engine.cuda_ops import CudaFusedOps
    from pdserve.engine.layers import EagerOps, RotaryEmbedding
    from pdserve.engine.model_config import ModelConfig

    torch.manual_seed(0)
    dev = torch.device("cuda")
    x = torch.randn(37, 4096, device=dev).to(dtype)
    res = torch.randn(37, 4096, device=dev).to(dtype)
    w = (torch.rand(4096, device=dev) + 0.5).to(dtype)
    xe, xf = x.clone(), x.clone()
    want, got = EagerOps.add_rms_norm(xe, res, w, 1e-5), CudaFusedOps.add_rms_norm(xf, res, w, 1e-5)
    assert torch.equal(xf, xe)
    rtol = {torch.float32: 2e-6, torch.bfloat16: 2**-6, torch.float16: 2**-9}[dtype]  # two ulps
    torch.testing.assert_close(got, want, atol=1e-6, rtol=rtol)
    gate_up = (torch.randn(37, 2 * 14336, device=dev) * 3).to(dtype)
    torch.testing.assert_close(CudaFusedOps.silu_mul(gate_up), EagerOps.silu_mul(gate_up), atol=1e-6, rtol=rtol)
    cfg = ModelConfig.from_dict(
        dict(architectures=["LlamaForCausalLM"], hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=64, num_hidden_layers=1, vocab_size=100, max_position_embeddings=8192,
             rope_theta=500000.0)
    )  # fmt: skip
    cos, sin = RotaryEmbedding(cfg, dev).cos_sin(torch.arange(4000, 4037, device=dev), dtype)
    qkv = torch.randn(37, 48 * 128, device=dev).to(dtype)
    for g, e in zip(
        CudaFusedOps.rotate_qk(qkv.clone(), cos, sin, 32, 8, 128), EagerOps.rotate_qk(qkv.clone(), cos, sin, 32, 8, 128)
    ):
        ulp = qkv.abs().max().item() * {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
        torch.testing.assert_close(g, e, atol=ulp, rtol=0)
