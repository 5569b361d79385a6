"""engine.cpu_malloc: freed activation-sized blocks are reused, not faulted in again."""

from __future__ import annotations

import ctypes
import random
import resource

import pytest
import torch

from engine.cpu_malloc import keep_freed_memory


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
    except OSError:
        return False


def _steps(rounds: int, seed: int) -> None:
    """Activation-like traffic: each step's MLP and hidden buffers of varying rows, the hidden ones
    living on into the next step (as a layer's output lives into the next layer)."""
    rng = random.Random(seed)
    hidden = out = None
    for _ in range(rounds):
        rows = rng.choice([1, 16, 64, 128, 256, 512, 2048])
        gate_up = torch.empty(rows, 3072).fill_(1)
        hidden = torch.empty(rows, 768).fill_(2)
        del gate_up
        out = torch.empty(rows, 1536).fill_(3)
    del hidden, out


@pytest.mark.skipif(not _glibc(), reason="the settings are glibc's")
def test_freed_activations_are_reused_without_page_faults():
    assert keep_freed_memory() and keep_freed_memory()  # applied, and idempotent
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every fault in this thread: other threads of the test process are not counted
    try:
        _steps(600, seed=0)  # the heap grows to the working set (faults expected)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        _steps(300, seed=1)  # ~700 thousand pages touched; glibc's defaults faulted 70-120 thousand of them
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    finally:
        torch.set_num_threads(threads)
    assert faults < 5000, f"{faults} page faults: freed blocks are not being kept for reuse"
