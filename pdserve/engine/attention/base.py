"""The attention backend interface and the per-step metadata both backends share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from pdserve.engine.attention.plan import slot_mapping
from pdserve.engine.forward_batch import ForwardBatch


@dataclass
class AttentionMetadata:
    """Tensors derived once per step from a ForwardBatch, reused by every layer."""

    batch: ForwardBatch
    block_size: int
    slot_blocks: torch.Tensor
    """[T] block id receiving each new token's K/V."""
    slot_offsets: torch.Tensor
    """[T] offset inside that block."""
    positions: torch.Tensor
    """[T] absolute position of each new token."""
    sliding_window: int | None = None
    """The model's attention window: a query at position i sees keys i - W + 1 .. i (None: 0 .. i)."""
    decode_table: torch.Tensor | None = None
    """int32 [S, P]: a decode step's block tables already on the device (a CUDA graph's fixed-width
    input, engine.cuda_graphs); None: the backend builds them from `batch`, once per step (the
    torch backend keeps them here for the step's later layers)."""
    decode_ctx: torch.Tensor | None = None
    """int32 [S]: each sequence's context length, on the device, beside `decode_table`."""

    @classmethod
    def build(
        cls, batch: ForwardBatch, block_size: int, device: torch.device, sliding_window: int | None = None
    ) -> "AttentionMetadata":
        blocks, offsets, positions = slot_mapping(batch.query_lens, batch.context_lens, batch.block_tables, block_size)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return cls(batch, block_size, as_tensor(blocks), as_tensor(offsets), as_tensor(positions), sliding_window)


def store_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Scatter the step's new K/V ([T, Hkv, D] each) into their slots of the pool layer [N, P, Hkv, B, D].
    A one-plane layer (MLA) stores `k` only: its latent is both key and value (`v` is the same tensor)."""
    kv_layer[:, 0][meta.slot_blocks, :, meta.slot_offsets] = k
    if kv_layer.shape[1] == 2:
        kv_layer[:, 1][meta.slot_blocks, :, meta.slot_offsets] = v


def kv_pages(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value pages ([N, Hkv, B, D] views) of a pool layer [N, P, Hkv, B, D]: planes 0 and 1,
    or plane 0 twice (one object: callers gather it once) for a one-plane (MLA) layer, whose latent
    is read as both."""
    keys = kv_layer[:, 0]
    return keys, keys if kv_layer.shape[1] == 1 else kv_layer[:, 1]


class AttentionBackend(ABC):
    """Writes the step's new K/V into the pool and attends over each sequence's pages."""

    def configure(self, num_qo_heads: int, dtype: torch.dtype, *, attention_sinks: bool = False) -> None:
        """Facts of the model the backend may need before the first step (query heads, KV dtype,
        whether layers pass `sinks`); what the backend cannot run is refused here, at start, never at
        request time."""

    def wait_ready(self) -> None:
        """Block until optional compiled kernels are loaded (benchmarks, tests); most backends have none."""

    @property
    def uses_kernel(self) -> bool:
        """True while steps run the compiled CPU ops of `cpu_build`; the model then uses its fused
        elementwise ops too (decided per step, after `begin_step`)."""
        return False

    def begin_step(self, meta: AttentionMetadata, kv_layer_shape: torch.Size) -> None:
        """Per-step planning (flashinfer plans its wrappers here); the torch backend needs none."""

    @abstractmethod
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
        """q: [T, Hq, D], k/v: [T, Hkv, D], kv: [N, P, Hkv, B, D] -> out [T, Hq, D]; P = 2 (K, V),
        or 1 for MLA (k and v are then the same latent, stored once and read as both).

        `window`: this layer's attention window (`layer_window`): None, the step's
        `meta.sliding_window`; 0, none on this layer; W > 0, the last W keys. `sinks`: float [Hq], one
        logit per query head that joins each query's softmax denominator and nothing else (gpt-oss;
        transformers appends it to the scores, softmaxes, and drops it)."""


def layer_window(meta: AttentionMetadata, window: int | None) -> int | None:
    """The window a layer attends within (None: all keys), from `forward`'s `window` argument."""
    if window is None:
        return meta.sliding_window
    return window or None
