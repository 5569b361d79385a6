"""KVPool: the one KV-cache tensor of a process, HND inside each block."""

from __future__ import annotations

import torch

from engine.model_config import ModelConfig


def kv_bytes_per_token(config: ModelConfig, num_layers: int, dtype: torch.dtype) -> int:
    """K and V of one token over `num_layers` layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_key_value_heads * config.head_dim * itemsize * num_layers


class KVPool:
    """`tensor`: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim].

    One layer's block (K and V of `block_size` tokens) is one contiguous region
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
        self.dtype = dtype
        self.block_bytes = kv_bytes_per_token(config, 1, dtype) * block_size
        if tensor is not None:
            want = (num_layers, tensor.shape[1], 2, self.num_kv_heads, block_size, self.head_dim)
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
            shape = (num_layers, self.num_blocks, 2, self.num_kv_heads, block_size, self.head_dim)
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.tensor = tensor

    def layer(self, local_layer: int) -> torch.Tensor:
        """[num_blocks, 2, num_kv_heads, block_size, head_dim] view of one layer."""
        return self.tensor[local_layer]
