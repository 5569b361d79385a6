"""How big the KV pool is: a byte budget on CPU, a profiled share of the card on CUDA (as vLLM sizes it).

Both devices answer one question through `KvMemory.budget_bytes(runner)`; the pool then holds
`budget // bytes_per_block` blocks and `fit_max_model_len` checks that one longest sequence fits.
"""

from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI parses memory sizes without importing torch
    import torch

    from pdserve.engine.cuda_memory import CudaBaseline, CudaMemoryProfile, ProfiledRunner

CPU_KV_FRACTION = 0.1
"""Default CPU budget: this share of the host's available memory. Small, because several processes
share a host (`pdserve up` runs three nodes; a batch job one per stage) and each allocates its pool."""
CPU_KV_MAX_FULL_SEQS = 64
"""The default CPU pool holds at most this many sequences of max_model_len tokens (fewer with a lower
max_num_seqs). max_num_seqs is 256 as in vLLM, but the CPU pool is allocated and zeroed up front, so
every byte of it is resident: 256 full-length sequences of the built-in model would pin ~2 GiB per
node (three under `pdserve up`) that CPU compute could rarely fill. 256 sequences of a quarter of the
context still fit; --kv-cache-memory asks for more."""
MIN_DEFAULT_CPU_KV_BYTES = 64 * 1024**2
"""Floor of the default CPU budget, so a host short of memory still gets a usable pool."""
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_memory_size(text: str | int) -> int:
    """Bytes from `4294967296`, `4GiB`, `512MiB`, `4G` (binary) or `4GB` (decimal); ValueError otherwise."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(text)
        if m is None:
            raise ValueError(f"memory size must be bytes or a number with a unit like 4GiB or 512MiB, got {text!r}")
        number, unit, binary, b = m.groups()
        # "GB" is decimal (10^9), "GiB" and a bare "G" binary (2^30), as Kubernetes and vLLM read them
        scale = 1000 ** " kmgt".index(unit.lower()) if unit and b and not binary else _UNITS[unit.lower()]
        value = int(float(number) * scale)
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value


def available_memory_bytes() -> int:
    """MemAvailable of this host (Linux), else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_cpu_kv_bytes(bytes_per_token: int, max_num_seqs: int, max_model_len: int, available: int) -> int:
    """A tenth (CPU_KV_FRACTION) of the available memory, but never more than `max_num_seqs` sequences of
    `max_model_len` tokens can fill (a pool beyond that only holds more cached prefixes)."""
    share = max(int(available * CPU_KV_FRACTION), MIN_DEFAULT_CPU_KV_BYTES)
    return min(share, bytes_per_token * max_num_seqs * max_model_len)


def cuda_kv_bytes(profile: CudaMemoryProfile, utilization: float) -> int:
    """KV = utilization x card - weights - peak activations - decode graphs - other memory this
    process added;
    ValueError naming the flag when that leaves nothing, or when the card has not that much free."""
    budget = int(profile.total_bytes * utilization)
    if budget > profile.free_at_start_bytes:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} asks for {_gib(budget)} of the card's "
            f"{_gib(profile.total_bytes)}, but only {_gib(profile.free_at_start_bytes)} was free at start "
            f"(another process uses the GPU): lower --gpu-memory-utilization"
        )
    used = profile.weights_bytes + profile.peak_activation_bytes + profile.non_torch_bytes + profile.graph_bytes
    kv = budget - used
    if kv <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} gives {_gib(budget)}, but weights "
            f"({_gib(profile.weights_bytes)}), peak activations ({_gib(profile.peak_activation_bytes)}), "
            f"CUDA graphs ({_gib(profile.graph_bytes)}) and other memory ({_gib(profile.non_torch_bytes)}) "
            f"already take {_gib(used)}: raise --gpu-memory-utilization, lower --max-num-batched-tokens, or "
            f"pass --enforce-eager"
        )
    return kv


def fit_max_model_len(requested: int | None, model_max: int, num_blocks: int, block_size: int) -> int:
    """The max_model_len to serve. An explicit `requested` that one sequence cannot fill the pool
    with is refused (ValueError naming the flags); the default (the model's maximum) is lowered to
    what the pool holds, so the router never advertises a length no request can reach."""
    capacity = num_blocks * block_size
    if requested is not None:
        wanted = min(requested, model_max)
        if wanted > capacity:
            raise ValueError(
                f"--max-model-len {requested} does not fit the KV pool: it holds {capacity} tokens "
                f"({num_blocks} blocks of {block_size}); raise --kv-cache-memory (CPU), "
                f"--gpu-memory-utilization (CUDA) or --num-kv-blocks, or lower --max-model-len"
            )
        return wanted
    return min(model_max, capacity)


class KvMemory(ABC):
    """How many bytes this process gives the KV pool."""

    needs_weights = False
    """True when the budget is measured with the weights loaded (then after `before_load`); False
    when it is known before, so that an impossible --max-model-len is refused before the load."""

    def before_load(self, device: torch.device) -> None:
        """Called before the weights load (CUDA takes its baseline counters here)."""

    @abstractmethod
    def budget_bytes(self, runner: ProfiledRunner, bytes_per_token: int) -> int:
        """The pool's budget; `bytes_per_token` is the KV of one token over the runner's layers."""


def kv_memory_for(
    device: torch.device,
    kv_cache_bytes: int | None,
    gpu_memory_utilization: float,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> KvMemory:
    """An explicit byte budget on any device; else the host's share on CPU, a profiled share on CUDA."""
    if device.type == "cuda" and kv_cache_bytes is None:
        return CudaKvMemory(gpu_memory_utilization, max_num_seqs, max_num_batched_tokens)
    return CpuKvMemory(kv_cache_bytes, max_num_seqs)


class CpuKvMemory(KvMemory):
    """`--kv-cache-memory` when given (on any device), else `default_cpu_kv_bytes` of the host's
    available memory."""

    def __init__(self, requested_bytes: int | None, max_num_seqs: int) -> None:
        self.requested_bytes = requested_bytes
        self.max_num_seqs = max_num_seqs

    def budget_bytes(self, runner: ProfiledRunner, bytes_per_token: int) -> int:
        if self.requested_bytes is not None:
            return self.requested_bytes
        full_seqs = min(self.max_num_seqs, CPU_KV_MAX_FULL_SEQS)
        return default_cpu_kv_bytes(bytes_per_token, full_seqs, runner.max_model_len, available_memory_bytes())


class CudaKvMemory(KvMemory):
    """`--gpu-memory-utilization`: profile a forward at the maximum batch, give KV the rest.

    Checked on one H200 (tests/gpu/test_cuda_kv_sizing.py, 2026-11-26); CI has no GPU, so its
    arithmetic (`cuda_kv_bytes`) is also unit-tested on CPU with numbers injected through `measure`."""

    needs_weights = True

    def __init__(self, utilization: float, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.utilization = utilization
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.baseline: CudaBaseline | None = None

    def before_load(self, device: torch.device) -> None:
        from pdserve.engine.cuda_memory import CudaBaseline

        self.baseline = CudaBaseline.take(device)

    def measure(self, runner: ProfiledRunner) -> CudaMemoryProfile:
        from pdserve.engine.cuda_memory import measure_cuda_memory

        assert self.baseline is not None, "before_load() takes the baseline before the weights load"
        return measure_cuda_memory(runner, self.baseline, self.max_num_seqs, self.max_num_batched_tokens)

    def budget_bytes(self, runner: ProfiledRunner, bytes_per_token: int) -> int:
        return cuda_kv_bytes(self.measure(runner), self.utilization)


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"
