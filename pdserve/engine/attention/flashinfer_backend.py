"""flashinfer paged attention for CUDA (kv_layout="HND").

The development and CI machines have no GPU and flashinfer has no CPU path, so
this runs only in the GPU tests (`pytest -m gpu`; run on an H100 with
flashinfer 0.7.2, see docs/benchmark-log.md). The planning arithmetic lives in
`engine.attention.plan` and is unit-tested on CPU; this module only feeds it to
flashinfer's wrappers.
Install with `pip install pdserve[gpu]`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata, layer_window, store_kv
from pdserve.engine.attention.plan import paged_plan

WORKSPACE_BYTES = 128 * 1024 * 1024
KERNEL_BACKEND = "fa2"
"""flashinfer's FlashAttention-2 kernels: they run on every CUDA arch and JIT-compile in a fraction of
the time of the Hopper-only FA3 path that `auto` would pick on an H100."""


class FlashInferAttention(AttentionBackend):
    """BatchPrefill/BatchDecodeWithPagedKVCacheWrapper over the HND pool, planned once per step."""

    def __init__(self) -> None:
        import flashinfer  # imported here so the core never needs the [gpu] extra

        self._fi = flashinfer
        # flashinfer's wrappers (the library has no type information)
        self._wrappers: dict[str, Any] = {}
        self._active: Any = None

    def _wrapper(self, kind: str, device: torch.device) -> Any:
        if kind not in self._wrappers:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            cls = (
                self._fi.BatchDecodeWithPagedKVCacheWrapper
                if kind == "decode"
                else self._fi.BatchPrefillWithPagedKVCacheWrapper
            )
            self._wrappers[kind] = cls(workspace, kv_layout="HND", backend=KERNEL_BACKEND)
        return self._wrappers[kind]

    def begin_step(self, meta: AttentionMetadata, kv_layer_shape: torch.Size) -> None:
        # kv_layer_shape: [N, 2, Hkv, B, D]
        _, planes, hkv, page, d = kv_layer_shape
        if planes != 2:  # the engine picks the torch backend for these (`backend_for_planes`): never here
            raise ValueError(
                f"the flashinfer backend reads K and V planes; this pool has {planes} (MLA's latent): use the "
                "torch backend"
            )
        b = meta.batch
        plan = paged_plan(b.query_lens, b.context_lens, b.block_tables, page)
        dev = meta.positions.device
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
        hq = self.num_qo_heads
        self._scale = d**-0.5  # what the plan bakes in; forward() checks the model asks for the same
        # both wrappers take the paged-KV layout and head geometry the same way; prefill also its query ranges
        paged_kv = (as_i32(plan.kv_indptr), as_i32(plan.kv_indices), as_i32(plan.kv_last_page_len), hq, hkv, d, page)
        # a sliding window of W keys is flashinfer's window_left = W - 1 (keys i - W + 1 .. i); -1: none
        window_left = meta.sliding_window - 1 if meta.sliding_window is not None else -1
        plan_kw = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self._scale, window_left=window_left)
        if b.is_decode_only:
            w = self._wrapper("decode", dev)
            w.plan(*paged_kv, **plan_kw)
        else:
            w = self._wrapper("prefill", dev)
            w.plan(as_i32(plan.qo_indptr), *paged_kv, causal=True, **plan_kw)
        self._active = w

    def configure(self, num_qo_heads: int, dtype: torch.dtype, *, attention_sinks: bool = False) -> None:
        """Facts the plan needs that the pool shape does not carry; attention sinks (gpt-oss) are
        refused: the wrappers' softmax has no sink term (the torch backend serves them on CUDA)."""
        if attention_sinks:
            raise ValueError(
                "the flashinfer backend has no attention sinks, which this model (gpt-oss) needs: "
                "use the torch backend (--attention-backend torch)"
            )
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"the flashinfer backend runs float16 or bfloat16 KV, not {dtype} "
                "(use dtype bfloat16 or the torch backend)"
            )
        self.num_qo_heads = num_qo_heads
        self.dtype = dtype

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv: Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        # one plan per step, made with the step's model-wide window: a layer's own window or sinks
        # cannot run on it (configure refuses sinks; no served model without them windows per layer)
        if sinks is not None or layer_window(meta, window) != meta.sliding_window:
            raise ValueError("the flashinfer backend runs neither attention sinks nor per-layer windows")
        # write this step's K/V into the pages first: kv [N, 2, Hkv, B, D]
        store_kv(kv, k, v, meta)
        assert self._active is not None, "begin_step() must plan before forward()"
        if abs(scale - self._scale) > 1e-9:
            raise ValueError(f"flashinfer was planned with sm_scale {self._scale}, the model asks for {scale}")
        return self._active.run(q, kv)
