"""The Triton paged decode kernel (engine.attention.triton_decode) under Triton's interpreter on CPU,
against the torch backend's gather + SDPA decode; on CUDA it runs compiled in `pytest -m gpu`."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pdserve.engine.attention import triton_decode
from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.attention.torch_backend import TorchAttention, decode_tables
from pdserve.engine.forward_batch import ForwardBatch

pytestmark = pytest.mark.skipif(not triton_decode.available(), reason="triton is not installed")


pytestmark = [
    pytestmark,
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU machine runs the kernel compiled (tests/gpu)"
    ),
]


def _case(seed: int, hq: int, hkv: int, d: int, page: int, dtype: torch.dtype):
    rng = random.Random(seed)
    ctx = [rng.randrange(1, 150) for _ in range(5)] + [1, page, page + 1]
    n_blocks = sum((c + page - 1) // page for c in ctx) + 3
    order = list(range(n_blocks))
    rng.shuffle(order)  # scattered pages
    tables, used = [], 0
    for c in ctx:
        n = (c + page - 1) // page
        tables.append(order[used : used + n] + [order[-1]] * rng.randrange(0, 3))  # longer rows are fine
        used += n
    kv = torch.randn(n_blocks, 2, hkv, page, d).to(dtype)
    q = torch.randn(len(ctx), hq, d).to(dtype)
    batch = ForwardBatch([str(i) for i in ctx], [0] * len(ctx), [1] * len(ctx), ctx, tables, [True] * len(ctx))
    return q, kv, batch


def _reference(q, kv, batch, page, window, sinks):
    meta = AttentionMetadata.build(batch, page, q.device)
    return TorchAttention()._decode(q, kv[:, 0], kv[:, 1], meta, q.shape[-1] ** -0.5, window, sinks)


@pytest.mark.parametrize(
    "hq,hkv,d,page",
    [(8, 2, 32, 16), (6, 6, 16, 4), (4, 1, 40, 16), (16, 4, 64, 64)],
    ids=["gqa4", "mha-page4", "mqa-d40", "page64"],
)
@pytest.mark.parametrize("window,with_sinks", [(None, False), (20, False), (None, True), (9, True)])
@pytest.mark.parametrize("splits", [1, 3], ids=["one-program", "split-3"])
def test_kernel_equals_the_gather_decode(hq, hkv, d, page, window, with_sinks, splits):
    """One program per (sequence, KV head), and the context split over three merged by the reducer
    (some splits then hold no key at all: short contexts, windows)."""
    q, kv, batch = _case(hq * d + page, hq, hkv, d, page, torch.float32)
    sinks = torch.randn(hq) if with_sinks else None
    table, ctx = decode_tables(batch, page, q.device)
    got = triton_decode.paged_decode(q, kv[:, 0], kv[:, 1], table, ctx, d**-0.5, window, sinks, splits=splits)
    torch.testing.assert_close(got, _reference(q, kv, batch, page, window, sinks), atol=2e-6, rtol=1e-5)


def test_half_precision_inputs():
    q, kv, batch = _case(3, 8, 2, 32, 16, torch.float16)
    table, ctx = decode_tables(batch, 16, q.device)
    got = triton_decode.paged_decode(q, kv[:, 0], kv[:, 1], table, ctx, 32**-0.5)
    want = _reference(q.float(), kv.float(), batch, 16, None, None)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=3e-3, rtol=3e-3)


def test_a_fixed_width_table_reads_only_each_rows_context():
    """A CUDA graph's table is wider than any row needs, its tail stale: the kernel never reads it."""
    q, kv, batch = _case(5, 4, 2, 16, 16, torch.float32)
    table, ctx = decode_tables(batch, 16, q.device)
    wide = torch.full((table.shape[0], table.shape[1] + 7), 10**6, dtype=torch.int32)  # out of the pool
    wide[:, : table.shape[1]] = table
    for i, c in enumerate(batch.context_lens):
        wide[i, (c + 15) // 16 :] = 10**6
    for splits in (1, 4):
        got = triton_decode.paged_decode(q, kv[:, 0], kv[:, 1], wide, ctx, 16**-0.5, splits=splits)
        torch.testing.assert_close(got, _reference(q, kv, batch, 16, None, None), atol=2e-6, rtol=1e-5)


def test_split_count_fills_the_device_and_is_fixed_by_the_shape():
    cpu = torch.device("cpu")  # the interpreter's stand-in device wants 8 programs
    assert triton_decode.split_count(16, 4096, 64, cpu) == 1  # enough pairs already
    assert triton_decode.split_count(2, 4096, 64, cpu) == 4
    assert triton_decode.split_count(1, 100, 64, cpu) == 2  # never more splits than tiles
    assert triton_decode.split_count(1, 10**6, 64, cpu) == 8


def test_refusals():
    q, kv, batch = _case(7, 6, 4, 16, 16, torch.float32)  # 6 heads over 4 KV heads
    table, ctx = decode_tables(batch, 16, q.device)
    with pytest.raises(ValueError, match="do not group"):
        triton_decode.paged_decode(q, kv[:, 0], kv[:, 1], table, ctx, 0.25)
