"""KV memory that a pipeline's local stages share, for the phase split (`stage_split.PipelineSplit`).

With the phase split two neighbouring stages both run some layers (one for prefill batches, the
other for decode steps), so both must see those layers' KV. The launcher creates one anonymous
shared-memory file (`memfd_create`) holding every layer's pool, in `KVPool`'s layout, and hands
its descriptor to the stage processes it starts (`subprocess.Popen(pass_fds=...)`); each stage
maps it and keeps the rows of the layers it holds. The file has no name, so nothing is left
behind however the job ends: the memory goes back when the last stage exits. Memory is taken as
pages are first written, as with a private pool.

Only for stages on the launcher's host and CPU memory (a CUDA pool would need CUDA IPC; not built).
"""

from __future__ import annotations

import math
import os

import torch

from pdserve.engine.model_config import ModelConfig


def available() -> bool:
    """Whether this OS can create the shared file (Linux: memfd_create and /proc/self/fd)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Every layer's pool, in `KVPool`'s layout (`kv_planes`: 2, or 1 for an MLA latent)."""
    return (cfg.num_hidden_layers, num_blocks, cfg.kv_planes, cfg.num_key_value_heads, block_size, cfg.head_dim)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def create(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
    """A new shared file sized for every layer's `num_blocks` blocks; returns its descriptor,
    which the caller closes once the stage processes have it."""
    fd = os.memfd_create("pdserve-kv", 0)
    try:
        os.ftruncate(fd, _nbytes(_shape(cfg, num_blocks, block_size), dtype))
    except OSError:
        os.close(fd)
        raise
    return fd


def map_layers(
    fd: int, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, layers: tuple[int, int]
) -> torch.Tensor:
    """The pool tensor of `layers` ([end - start, num_blocks, planes, kv heads, block_size, head_dim])
    over the shared file `fd` (inherited from the launcher); writes are seen by every stage."""
    if fd < 0:
        raise ValueError("the phase split needs the shared KV file of a local launcher (pdserve batch)")
    shape = _shape(cfg, num_blocks, block_size)
    want = _nbytes(shape, dtype)
    have = os.fstat(fd).st_size
    if have != want:  # another block count or dtype than the launcher's: the stages would disagree
        raise ValueError(f"shared KV file (fd {fd}) holds {have} bytes, this stage needs {want}")
    whole = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=math.prod(shape), dtype=dtype).view(shape)
    start, end = layers
    return whole[start:end]
