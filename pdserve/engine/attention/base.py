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

    @classmethod
    def build(
        cls, batch: ForwardBatch, block_size: int, device: torch.device, sliding_window: int | None = None
    ) -> "AttentionMetadata":
        blocks, offsets, positions = slot_mapping(batch.query_lens, batch.context_lens, batch.block_tables, block_size)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return cls(batch, block_size, as_tensor(blocks), as_tensor(offsets), as_tensor(positions), sliding_window)


def store_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
    """Scatter the step's new K/V ([T, Hkv, D] each) into their slots of the pool layer [N, 2, Hkv, B, D]."""
    kv_layer[:, 0][meta.slot_blocks, :, meta.slot_offsets] = k
    kv_layer[:, 1][meta.slot_blocks, :, meta.slot_offsets] = v


class AttentionBackend(ABC):
    """Writes the step's new K/V into the pool and attends over each sequence's pages."""

    def configure(self, num_qo_heads: int, dtype: torch.dtype) -> None:
        """Facts of the model the backend may need before the first step (query heads, KV dtype);
        a dtype the backend cannot run is refused here, at start, never at request time."""

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
    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D], kv: [N, 2, Hkv, B, D] -> out [T, Hq, D]."""
