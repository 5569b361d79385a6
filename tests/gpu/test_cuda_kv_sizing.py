"""--gpu-memory-utilization on a real card: the profiled KV pool fits the share asked for and grows
with it (the arithmetic alone is tests/engine/test_kv_sizing.py, on CPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.cuda_memory import CudaBaseline
from pdserve.engine.kv_sizing import CudaKvMemory
from pdserve.engine.model_runner import ModelRunner
from tests.gpu.helpers import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


class Recording(CudaKvMemory):
    """The real measurement, kept for the assertions."""

    def measure(self, runner):
        self.profile = super().measure(runner)
        return self.profile


def _pool_bytes(runner: ModelRunner) -> int:
    t = runner.kv_pool.tensor
    return t.numel() * t.element_size()


def test_profiled_pool_fits_the_share_and_grows_with_it(tiny_model_dir):
    sizes = {}
    for utilization in (0.1, 0.2):
        memory = Recording(utilization, max_num_seqs=64, max_num_batched_tokens=2048)
        runner = ModelRunner(
            tiny_model_dir, device="cuda", dtype="float32", attention_backend="torch", kv_memory=memory
        )
        p = memory.profile
        assert p.weights_bytes > 0 and p.peak_activation_bytes > 0
        assert _pool_bytes(runner) <= utilization * p.total_bytes - p.weights_bytes - p.peak_activation_bytes
        sizes[utilization] = runner.kv_pool.num_blocks
        del runner
        torch.cuda.empty_cache()
    assert sizes[0.2] > sizes[0.1] * 1.5, sizes
    assert CudaBaseline.take(torch.device("cuda")).free_bytes > 0


def test_engine_with_default_sizing_serves(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cuda", dtype="float32", attention_backend="torch", gpu_memory_utilization=0.2)
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.max_model_len == llm.engine.model_config.max_position_embeddings


def test_an_engine_dropped_in_the_process_leaves_its_share_to_the_next(tiny_model_dir):
    """A second engine in one process sizes from the card as the first one left it: the first one's
    pool (0.5 of the card) is returned even if a reference cycle still held it."""
    first = LLM(tiny_model_dir, device="cuda", dtype="float32", attention_backend="torch", gpu_memory_utilization=0.5)
    cycle = [first]
    cycle.append(cycle)  # what a callback or a closure over the engine would leave behind
    del first, cycle
    second = LLM(tiny_model_dir, device="cuda", dtype="float32", attention_backend="torch", gpu_memory_utilization=0.9)
    out = second.generate(["hello"], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2
    del second  # 0.9 of the card: returned before the next test starts its node processes
