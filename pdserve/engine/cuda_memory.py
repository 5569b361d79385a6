"""Measuring what a CUDA process needs besides its KV pool: weights, peak activations, other memory.

Run on hardware on 2026-11-26 (one H200, tests/gpu/test_cuda_kv_sizing.py); CI has no GPU. The
arithmetic that turns these numbers into a KV budget (`engine.kv_sizing.cuda_kv_bytes`) is
unit-tested on CPU with the numbers injected; this module only reads torch.cuda's counters around
one forward.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from pdserve.engine.block_manager import blocks_for
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelConfig

if TYPE_CHECKING:
    from pdserve.engine.kv_pool import KVPool


class ProfiledRunner(Protocol):
    """The model runner as the sizing code sees it. A Protocol rather than an import of
    engine.model_runner, which imports the sizing code: the import graph stays free of circles."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    layer_range: tuple[int, int]
    model_config: ModelConfig
    local_config: ModelConfig
    kv_pool: KVPool

    @property
    def is_first_stage(self) -> bool: ...

    def run(
        self, batch: ForwardBatch, *, connector: Any = None, hidden_states: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def graph_memory_bytes(self) -> int: ...


class CudaBaseline(NamedTuple):
    """torch.cuda's counters before the weights load (the CUDA context exists by then)."""

    free_bytes: int
    total_bytes: int
    allocated_bytes: int
    reserved_bytes: int

    @classmethod
    def take(cls, device: torch.device) -> CudaBaseline:
        # An engine dropped earlier in this process (a notebook's second LLM(...), a test after a
        # test) can still hold its KV pool through a reference cycle until the collector runs: run
        # it now, or that pool counts as another process's memory and the budget comes up short.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


class CudaMemoryProfile(NamedTuple):
    """What the KV budget is computed from (bytes)."""

    total_bytes: int
    """The card's memory; the budget is a share of it (`--gpu-memory-utilization`)."""
    free_at_start_bytes: int
    """Free before this process loaded anything: the most it can take on a shared card."""
    weights_bytes: int
    """Allocated by loading the weights."""
    peak_activation_bytes: int
    """Peak allocation of a forward at the largest batch, above the weights (and its scratch KV)."""
    non_torch_bytes: int
    """Device memory this process added outside torch's allocator (library workspaces, JIT modules)."""
    graph_bytes: int = 0
    """Held by the decode CUDA graphs (engine.cuda_graphs), measured by a trial capture."""


def profile_batch(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int) -> ForwardBatch:
    """The largest step the scheduler can form: `max_num_batched_tokens` fresh prompt tokens over
    `max_num_seqs` sequences (each at most `max_model_len`), every one sampled (vocab-wide logits)."""
    num_seqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    lens = [min(base + (1 if i < extra else 0), max_model_len) for i in range(num_seqs)]
    lens = [n for n in lens if n > 0]
    tables, next_block = [], 0
    for n in lens:
        tables.append(list(range(next_block, next_block + blocks_for(n, block_size))))
        next_block += len(tables[-1])
    return ForwardBatch(
        request_ids=[f"profile-{i}" for i in range(len(lens))],
        input_ids=[0] * sum(lens),
        query_lens=lens,
        context_lens=list(lens),
        block_tables=tables,
        sample_mask=[True] * len(lens),
    )


def measure_cuda_memory(
    runner: ProfiledRunner, baseline: CudaBaseline, max_num_seqs: int, max_num_batched_tokens: int
) -> CudaMemoryProfile:
    """Run `profile_batch` through `runner` on a scratch KV pool (freed after) and read the counters."""
    from pdserve.engine.kv_pool import KVPool

    dev = runner.device
    torch.cuda.synchronize(dev)
    after_load = torch.cuda.memory_allocated(dev)
    batch = profile_batch(max_num_seqs, max_num_batched_tokens, runner.max_model_len, runner.block_size)
    num_blocks = max(2, sum(len(t) for t in batch.block_tables))
    start, end = runner.layer_range
    scratch = KVPool(runner.local_config, end - start, runner.block_size, runner.dtype, dev, num_blocks=num_blocks)
    runner.kv_pool = scratch
    hidden = None
    if not runner.is_first_stage:  # a later pipeline stage starts from hidden states
        hidden = torch.zeros(batch.num_tokens, runner.model_config.hidden_size, dtype=runner.dtype, device=dev)
    before_run = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    runner.run(batch, hidden_states=hidden)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before_run
    free_now, total = torch.cuda.mem_get_info(dev)
    reserved_now = torch.cuda.memory_reserved(dev)
    used_increase = baseline.free_bytes - free_now
    non_torch = max(0, used_increase - (reserved_now - baseline.reserved_bytes))
    graph_bytes = runner.graph_memory_bytes()  # captured on the scratch pool, then dropped
    del runner.kv_pool, scratch, hidden
    torch.cuda.empty_cache()
    return CudaMemoryProfile(
        total_bytes=total,
        free_at_start_bytes=baseline.free_bytes,
        weights_bytes=after_load - baseline.allocated_bytes,
        peak_activation_bytes=max(0, peak),
        non_torch_bytes=non_torch,
        graph_bytes=graph_bytes,
    )
