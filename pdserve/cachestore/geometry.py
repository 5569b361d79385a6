"""Pool geometry and memory regions: the only things CacheStore knows about a KV pool."""

from __future__ import annotations

import os

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from pdserve.cachestore.heads import HeadLayout

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PoolGeometry:
    """A pool laid out as [num_layers, num_blocks, block_bytes]: (layer, block) is one contiguous region."""

    num_layers: int
    num_blocks: int
    block_bytes: int
    """Bytes of one layer's block (K and V of block_size tokens)."""
    heads: HeadLayout | None = None
    """The KV heads the pool holds (a tensor-parallel rank's share); None: whole blocks only."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PoolGeometry.{name} must be positive, got {getattr(self, name)}")
        if self.heads is not None and self.heads.block_bytes != self.block_bytes:
            raise ValueError(
                f"{self.heads.describe()} makes {self.heads.block_bytes}-byte blocks, not {self.block_bytes}"
            )

    def head_spans(self, layer: int, block_ids, lo: int, hi: int) -> list[tuple[int, int]]:
        """(offset, length) of heads [lo, hi) in each of `block_ids` of `layer`: two spans a block (K, V)."""
        assert self.heads is not None, "head-sliced access needs the pool's HeadLayout"
        return [span for b in block_ids for span in self.heads.spans(self.offset(layer, b), lo, hi)]

    def offset(self, layer: int, block: int) -> int:
        return (layer * self.num_blocks + block) * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.block_bytes


class Run(NamedTuple):
    """`count` consecutive blocks starting at src_block in the sender's pool and dst_block in the receiver's."""

    src_block: int
    dst_block: int
    count: int  # type: ignore[assignment]  # shadows tuple.count: the name every caller uses


def coalesce(src_blocks: list[int], dst_blocks: list[int]) -> list[Run]:
    """Group (src, dst) pairs into runs consecutive on both sides, so each run is one write."""
    assert len(src_blocks) == len(dst_blocks), "source and destination block lists differ in length"
    runs: list[Run] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and runs[-1].src_block + runs[-1].count == s and runs[-1].dst_block + runs[-1].count == d:
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
        else:
            runs.append(Run(s, d, 1))
    return runs


def block_runs(block_ids: Iterable[int]) -> list[tuple[int, int]]:
    """(first block, count) of each run of consecutive ids, in the order given: one contiguous
    range of a layer per run (a receive buffer, a memory window, a staged copy)."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


EMULATE_DEVICE_ENV = "PDSERVE_EMULATE_DEVICE_POOL"


class MemoryRegion:
    """A writable byte view of a pool plus, for device memory, the tensor it came from.

    CPU tensors and buffers are exposed directly as a memoryview, so the TCP
    receiver can `recv_into` the destination blocks without a copy. A CUDA pool
    is reached through a pinned host staging buffer (`cachestore.staging`; exercised
    on a GPU machine by the tests marked `gpu`).
    """

    def __init__(self, view: memoryview, tensor: torch.Tensor | None = None, is_device: bool | None = None) -> None:
        self.view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self.tensor = tensor
        self.is_device = (tensor is not None and getattr(tensor, "is_cuda", False)) if is_device is None else is_device
        """True: `view` is empty and the bytes are reached through `tensor` (host staging)."""

    @classmethod
    def from_tensor(cls, tensor) -> "MemoryRegion":
        """The region of a pool tensor: device memory for a CUDA tensor, or for any tensor when
        $PDSERVE_EMULATE_DEVICE_POOL=1 (tests: a node on CPU takes every device-pool path, staging
        and the GPUDirect choice included, as a CUDA node would)."""
        import torch

        assert tensor.is_contiguous(), "KV pool must be one contiguous allocation"
        if tensor.is_cuda or os.environ.get(EMULATE_DEVICE_ENV) == "1":
            return cls(memoryview(bytearray(0)), tensor, is_device=True)
        return cls(memoryview(tensor.view(torch.uint8).reshape(-1).numpy()), tensor)

    @classmethod
    def from_buffer(cls, buffer) -> "MemoryRegion":
        return cls(memoryview(buffer))

    @property
    def address(self) -> int:
        """Base virtual address (what an RDMA MR registers)."""
        if self.tensor is not None:
            return int(self.tensor.data_ptr())
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.view)) if not self.view.readonly else 0

    def __len__(self) -> int:
        if self.is_device:
            assert self.tensor is not None, "a device region is reached through its tensor"
            return self.tensor.numel() * self.tensor.element_size()
        return len(self.view)
