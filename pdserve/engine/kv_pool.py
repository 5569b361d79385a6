"""KVPool: the one KV-cache tensor of a process, HND inside each block."""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

from pdserve.engine.model_config import ModelConfig


def kv_bytes_per_token(config: ModelConfig, num_layers: int, dtype: torch.dtype) -> int:
    """K and V of one token over `num_layers` layers (MLA: its one latent, `config.kv_planes` = 1)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.kv_planes * config.num_key_value_heads * config.head_dim * itemsize * num_layers


log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back the 2 MiB-aligned interior of a CPU tensor's memory with transparent huge
    pages (madvise MADV_HUGEPAGE), before it is first touched; True if the kernel took the advice.

    Why: a decode step's attention reads every sequence's pages, 2 KiB of one head here and there
    across a pool of hundreds of MiB, and with 4 KiB pages nearly every read also missed the TLB. On
    a 2-core Sapphire Rapids, 128 sequences x 300 keys x 36 layers of bf16 K/V (1.4 GB) read at
    18.9 GB/s on 4 KiB pages and 20.3 GB/s on huge pages. Only the pool: for every allocation
    (torch's THP_MEM_ALLOC_ENABLE) each short-lived activation would fault and zero 2 MiB pages.
    Where THP is off ("never") or this is not Linux, it changes nothing."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) on the KV pool failed: errno %d", ctypes.get_errno())
        return False
    return True


class KVPool:
    """`tensor`: [num_layers, num_blocks, planes, num_kv_heads, block_size, head_dim].

    `planes` is `config.kv_planes`: 2 (K then V) for multi-head attention, 1 for MLA, whose one
    latent per token (num_kv_heads 1, head_dim the latent width) is both key and value, stored once.
    One layer's block (its planes of `block_size` tokens) is one contiguous region
    of `block_bytes` bytes, so a run of consecutive blocks of one layer is one
    RDMA write or one TCP frame, and the whole pool is one memory registration.
    It is a plain allocation (torch.zeros -> cudaMalloc on GPU, malloc on CPU),
    never a stream-ordered allocator region, which GPUDirect RDMA cannot register.
    Its size is decided before (`engine.kv_sizing`): either `num_blocks` or a `budget_bytes`.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_layers: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int | None = None,
        budget_bytes: int | None = None,
        tensor: torch.Tensor | None = None,
    ) -> None:
        """`tensor`: the pool's memory, allocated by the caller in the shape above (a pipeline
        stage's view of KV that its neighbour maps too: tdpipe.runtime.shared_kv); it sets
        `num_blocks`. Else the pool allocates `num_blocks`, or as many as `budget_bytes` holds."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.planes = config.kv_planes
        self.dtype = dtype
        self.block_bytes = kv_bytes_per_token(config, 1, dtype) * block_size
        if tensor is not None:
            want = (num_layers, tensor.shape[1], self.planes, self.num_kv_heads, block_size, self.head_dim)
            if tuple(tensor.shape) != want or tensor.dtype != dtype or not tensor.is_contiguous():
                raise ValueError(f"KV tensor {tuple(tensor.shape)} {tensor.dtype} is not a contiguous {want} {dtype}")
            num_blocks = tensor.shape[1]
        if num_blocks is None:
            assert budget_bytes is not None, "the pool needs num_blocks or budget_bytes"
            num_blocks = budget_bytes // (self.block_bytes * max(num_layers, 1))
        if num_blocks < 2:
            raise ValueError(
                f"KV pool too small: {num_blocks} blocks (raise --kv-cache-memory, --gpu-memory-utilization "
                f"or --num-kv-blocks)"
            )
        self.num_blocks = int(num_blocks)
        if tensor is None:
            shape = (num_layers, self.num_blocks, self.planes, self.num_kv_heads, block_size, self.head_dim)
            if torch.device(device).type == "cpu":  # huge pages before the first touch (the zeroing)
                tensor = torch.empty(shape, dtype=dtype, device=device)
                advise_huge_pages(tensor)
                tensor.zero_()
            else:
                tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.tensor = tensor

    def layer(self, local_layer: int) -> torch.Tensor:
        """[num_blocks, planes, num_kv_heads, block_size, head_dim] view of one layer."""
        return self.tensor[local_layer]
