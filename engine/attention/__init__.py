"""Attention backends over the paged KV pool: `torch` (reference, any device) and `flashinfer` (CUDA)."""

from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata


def make_backend(name: str) -> AttentionBackend:
    """Build the backend called `name` ("torch" or "flashinfer")."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttention
        return TorchAttention()
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttention
        return FlashInferAttention()
    raise ValueError(f"attention_backend must be 'torch' or 'flashinfer', got {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "make_backend"]
