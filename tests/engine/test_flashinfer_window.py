"""The flashinfer backend plans Mistral's window as flashinfer's `window_left` (W - 1 keys before
the query; -1 for none). flashinfer needs CUDA, so its module is a recording fake here; the kernels
themselves run in the GPU tests."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.forward_batch import ForwardBatch


class _Wrapper:
    def __init__(self, workspace, kv_layout, backend) -> None:
        self.plans: list[dict] = []

    def plan(self, *args, **kwargs) -> None:
        self.plans.append(kwargs)


@pytest.fixture
def backend(monkeypatch):
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = _Wrapper  # type: ignore[attr-defined]
    fake.BatchPrefillWithPagedKVCacheWrapper = _Wrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    from pdserve.engine.attention.flashinfer_backend import FlashInferAttention

    b = FlashInferAttention()
    b.configure(4, torch.bfloat16)
    return b


@pytest.mark.parametrize("window, window_left", [(32, 31), (None, -1)])
@pytest.mark.parametrize("decode", [True, False])
def test_window_is_planned_as_window_left(backend, window, window_left, decode):
    q = [1, 1] if decode else [40, 1]
    batch = ForwardBatch(["a", "b"], [0] * sum(q), q, [40, 41], [[0, 1, 2], [3, 4, 5]], [True, True])
    meta = AttentionMetadata.build(batch, 16, torch.device("cpu"), window)
    backend.begin_step(meta, torch.Size([8, 2, 2, 16, 32]))
    assert backend._active.plans[-1]["window_left"] == window_left
