"""Attention backends over the paged KV pool: `torch` (reference, any device), `cpu_paged`
(C++ op reading pages in place, CPU) and `flashinfer` (CUDA)."""

from __future__ import annotations

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata

BACKENDS = ("torch", "cpu_paged", "flashinfer")


def resolve_backend(name: str, device_type: str) -> str:
    """ "auto" is `cpu_paged` on CPU (faster than `torch`, same results) and `torch` elsewhere."""
    if name == "auto":
        return "cpu_paged" if device_type == "cpu" else "torch"
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


__all__ = ["BACKENDS", "resolve_backend", "AttentionBackend", "AttentionMetadata", "make_backend"]
