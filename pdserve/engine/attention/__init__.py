"""Attention backends over the paged KV pool: `torch` (reference, any device), `cpu_paged`
(C++ op reading pages in place, CPU) and `flashinfer` (CUDA)."""

from __future__ import annotations

import logging

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("torch", "cpu_paged", "flashinfer")
log = logging.getLogger(__name__)


def resolve_backend(name: str, device_type: str) -> str:
    """ "auto" is `cpu_paged` on CPU (faster than `torch`, same results) and `torch` elsewhere."""
    if name == "auto":
        return "cpu_paged" if device_type == "cpu" else "torch"
    return name


def backend_for_planes(name: str, kv_planes: int) -> str:
    """`name`, unless the pool's geometry rules it out: flashinfer's paged kernels read separate K
    and V planes, and MLA's one-plane latent (MQA of head size kv_lora_rank + rope dims, 576 for
    DeepSeek) is not a layout they take, so such a model runs the torch backend on CUDA."""
    if name == "flashinfer" and kv_planes != 2:
        log.info("attention backend: torch, not flashinfer (the model's KV is one MLA latent plane)")
        return "torch"
    return name


def make_backend(name: str) -> AttentionBackend:
    """Build the backend called `name` (one of BACKENDS)."""
    if name == "torch":
        from pdserve.engine.attention.torch_backend import TorchAttention

        return TorchAttention()
    if name == "cpu_paged":
        from pdserve.engine.attention.cpu_paged_backend import CpuPagedAttention

        return CpuPagedAttention()
    if name == "flashinfer":
        from pdserve.engine.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention()
    raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")


__all__ = [
    "BACKENDS",
    "resolve_backend",
    "backend_for_planes",
    "AttentionBackend",
    "AttentionMetadata",
    "make_backend",
]
