"""Shared helpers of the GPU tests (collected only with `-m gpu`, skipped where CUDA is absent)."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


CUDA_NODE_FLAGS = [
    *("--device", "cuda", "--attention-backend", "torch", "--dtype", "float32"),
    # the cluster's processes share one card: each sizes its KV pool from its own share of it
    *("--gpu-memory-utilization", "0.25"),
]
"""Node flags of the CUDA cluster tests."""


def flashinfer_or_skip() -> None:
    from pdserve.commands.device_args import flashinfer_available

    if not flashinfer_available():
        pytest.skip("flashinfer is not installed")


def assert_greedy_close(ref, got, atol: float) -> int:
    """Two greedy completions (logprobs=2) agree: same tokens and logprobs within `atol`, up to a
    position where the reference's top-2 are within 2*atol (a legitimate tie at this precision),
    after which the sequences may diverge. Returns how many tokens were compared."""
    for i, (a, b) in enumerate(zip(ref.logprobs, got.logprobs)):
        if a.token_id != b.token_id:
            gap = a.top[0][1] - a.top[1][1]
            assert gap < 2 * atol, f"token {i}: {a.token_id} vs {b.token_id} with a top-2 gap of {gap:.4f}"
            return i
        assert abs(a.logprob - b.logprob) < atol, f"token {i}: logprob {a.logprob} vs {b.logprob}"
    return len(ref.logprobs)
