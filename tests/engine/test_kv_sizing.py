"""KV pool sizing: byte budgets, the CUDA profile arithmetic (numbers injected), the fit check, and
the load report's reserved blocks."""

from __future__ import annotations

import pytest

from pdserve.engine import kv_sizing
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_memory import CudaMemoryProfile, profile_batch
from pdserve.engine.kv_pool import kv_bytes_per_token
from pdserve.engine.kv_sizing import (
    CudaKvMemory,
    cuda_kv_bytes,
    default_cpu_kv_bytes,
    fit_max_model_len,
    parse_memory_size,
)
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.remote_prefill import RemotePrefillPolicy
from pdserve.engine.sampling_params import SamplingParams
from tests.engine.factories import add_remote

GiB, MiB = 1024**3, 1024**2


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GiB", 4 * GiB),
        ("512MiB", 512 * MiB),
        ("512mib", 512 * MiB),
        ("4G", 4 * GiB),
        ("4GB", 4 * 10**9),
        ("1.5GiB", int(1.5 * GiB)),
        ("1048576", 1048576),
        ("100B", 100),
        (" 2 KiB ", 2048),
        (7, 7),
    ],
)
def test_parse_memory_size(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4XB", "-1GiB", "0", "4 GiBs", "1e9"])
def test_parse_memory_size_rejects(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_memory_size(text)


def test_default_cpu_budget_is_a_share_of_available_memory_capped_by_what_can_be_used():
    # 1 KiB per token, 4 sequences of 1000 tokens could fill at most 4,096,000 bytes
    assert default_cpu_kv_bytes(1024, 4, 1000, available=8 * GiB) == 4 * 1000 * 1024
    # a large cap: a tenth of the available memory
    assert default_cpu_kv_bytes(1024, 64, 100_000, available=10 * GiB) == GiB
    # a host short of memory still gets the floor
    assert default_cpu_kv_bytes(1024, 64, 100_000, available=MiB) == kv_sizing.MIN_DEFAULT_CPU_KV_BYTES


def _profile(**kw) -> CudaMemoryProfile:
    base = dict(
        total_bytes=80 * GiB,
        free_at_start_bytes=79 * GiB,
        weights_bytes=16 * GiB,
        peak_activation_bytes=3 * GiB,
        non_torch_bytes=1 * GiB,
    )
    return CudaMemoryProfile(**{**base, **kw})


def test_cuda_budget_is_utilization_minus_weights_activations_and_other_memory():
    assert cuda_kv_bytes(_profile(), 0.9) == int(80 * GiB * 0.9) - 20 * GiB
    assert cuda_kv_bytes(_profile(), 0.5) == 40 * GiB - 20 * GiB


def test_cuda_budget_refuses_too_little_and_a_busy_card():
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        cuda_kv_bytes(_profile(), 0.25)  # 20 GiB budget, 20 GiB already used
    with pytest.raises(ValueError, match="lower --gpu-memory-utilization"):
        cuda_kv_bytes(_profile(free_at_start_bytes=30 * GiB), 0.9)


def test_profile_batch_is_the_largest_step():
    batch = profile_batch(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=100, block_size=4)
    assert batch.query_lens == [3, 3, 2, 2] and batch.context_lens == batch.query_lens
    assert all(batch.sample_mask) and batch.num_tokens == 10
    # pages do not overlap and cover each sequence
    pages = [p for t in batch.block_tables for p in t]
    assert len(pages) == len(set(pages)) == 1 + 1 + 1 + 1
    capped = profile_batch(max_num_seqs=1, max_num_batched_tokens=2048, max_model_len=64, block_size=16)
    assert capped.query_lens == [64]


def test_fit_check():
    assert fit_max_model_len(None, 4096, num_blocks=10, block_size=16) == 160  # default: what the pool holds
    assert fit_max_model_len(None, 100, num_blocks=10, block_size=16) == 100
    assert fit_max_model_len(160, 4096, num_blocks=10, block_size=16) == 160
    with pytest.raises(ValueError, match="--max-model-len 161 .*--kv-cache-memory.*--gpu-memory-utilization"):
        fit_max_model_len(161, 4096, num_blocks=10, block_size=16)


def _block_bytes(model_dir, dtype="float32", block_size=16) -> int:
    import torch

    cfg = ModelConfig.from_dir(model_dir)
    return kv_bytes_per_token(cfg, cfg.num_hidden_layers, getattr(torch, dtype)) * block_size


@pytest.mark.parametrize("budget", ["1MiB", "3MiB"])
def test_kv_cache_memory_sets_the_block_count(tiny_model_dir, budget):
    runner = ModelRunner(tiny_model_dir, kv_cache_bytes=parse_memory_size(budget), max_model_len=64)
    assert runner.kv_pool.num_blocks == parse_memory_size(budget) // _block_bytes(tiny_model_dir)


def test_default_cpu_budget_sets_the_block_count(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(kv_sizing, "available_memory_bytes", lambda: 1000 * MiB)
    engine = LLMEngine(EngineConfig(tiny_model_dir, max_num_seqs=1000))  # cap above the share: 100 MiB
    assert engine.block_manager.num_blocks == 100 * MiB // _block_bytes(tiny_model_dir)
    small = LLMEngine(EngineConfig(tiny_model_dir, max_num_seqs=2, max_model_len=256))
    assert small.block_manager.num_blocks == 2 * 256 // 16  # the cap: two full-length sequences
    # max_num_seqs 256 (vLLM's default) schedules 256 sequences; the default pool holds 64 full ones
    monkeypatch.setattr(kv_sizing, "available_memory_bytes", lambda: 100 * GiB)
    default = LLMEngine(EngineConfig(tiny_model_dir, max_model_len=256))
    assert default.scheduler.max_num_seqs == 256
    assert default.block_manager.num_blocks == kv_sizing.CPU_KV_MAX_FULL_SEQS * 256 // 16


class InjectedCuda(CudaKvMemory):
    """The CUDA sizing path with measured numbers injected (no GPU here)."""

    def __init__(self, utilization: float, profile: CudaMemoryProfile) -> None:
        super().__init__(utilization, max_num_seqs=8, max_num_batched_tokens=64)
        self.profile = profile
        self.loaded_before = False

    def before_load(self, device) -> None:
        self.loaded_before = True

    def measure(self, runner) -> CudaMemoryProfile:
        assert self.loaded_before and runner.model is not None, "measured after the weights load"
        return self.profile


@pytest.mark.parametrize("utilization", [0.5, 0.9])
def test_gpu_memory_utilization_sets_the_block_count(tiny_model_dir, utilization):
    profile = _profile(total_bytes=200 * MiB, free_at_start_bytes=200 * MiB, weights_bytes=10 * MiB,
                       peak_activation_bytes=20 * MiB, non_torch_bytes=5 * MiB)  # fmt: skip
    runner = ModelRunner(tiny_model_dir, kv_memory=InjectedCuda(utilization, profile), max_model_len=64)
    expected = (int(200 * MiB * utilization) - 35 * MiB) // _block_bytes(tiny_model_dir)
    assert runner.kv_pool.num_blocks == expected


def test_explicit_max_model_len_that_cannot_fit_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="--max-model-len 4096 does not fit"):
        LLMEngine(EngineConfig(tiny_model_dir, num_kv_blocks=8, max_model_len=4096))
    engine = LLMEngine(EngineConfig(tiny_model_dir, num_kv_blocks=8))  # the default is lowered instead
    assert engine.max_model_len == 8 * 16


def test_load_report_subtracts_blocks_reserved_by_never_preempt(tiny_model_dir):
    config = EngineConfig(tiny_model_dir, num_kv_blocks=64, block_size=4, preemption="never")
    engine = LLMEngine(config, connector=RemotePrefillPolicy())
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", [5] * 8, params)  # 2 blocks now, 7 over its life
    engine.step()
    bm = engine.block_manager
    assert bm.num_free_blocks == 64 - 2  # the prompt's blocks; the output's come as it grows
    assert engine.load().num_free_blocks == 64 - 7
    add_remote(engine, "b", [6] * 8, params)  # 2 blocks held, 7 promised
    assert engine.load().num_free_blocks == 64 - 14
    engine.abort("a")
    engine.abort("b")
    engine.step()
    assert engine.load().num_free_blocks == 64
    recompute = LLMEngine(EngineConfig(tiny_model_dir, num_kv_blocks=64, block_size=4))
    recompute.add_request("a", [5] * 8, params)
    recompute.step()
    assert recompute.load().num_free_blocks == recompute.block_manager.num_free_blocks  # nothing promised
    recompute.abort("a")


@pytest.mark.parametrize("sizing", [{"num_kv_blocks": 8}, {"kv_cache_bytes": MiB}])
def test_an_impossible_length_is_refused_before_the_weights_load(tiny_model_dir, monkeypatch, sizing):
    import pdserve.engine.model_runner

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the fit check")

    monkeypatch.setattr(pdserve.engine.model_runner, "load_tensors", no_load)
    with pytest.raises(ValueError, match="--max-model-len 4096 does not fit"):
        ModelRunner(tiny_model_dir, max_model_len=4096, **sizing)


def test_cuda_measurement_reads_the_counters_around_one_forward(tiny_model_dir, monkeypatch):
    """`measure_cuda_memory` run on CPU with torch.cuda's counters faked: it runs the profile batch
    through the runner on a scratch pool, removes that pool, and turns the counters into a profile."""
    import torch

    from pdserve.engine.cuda_memory import CudaBaseline, measure_cuda_memory

    allocated = iter([100 * MiB, 130 * MiB])  # after the weights load; with the scratch pool, before the run
    fake = {
        "synchronize": lambda device=None: None,
        "memory_allocated": lambda device=None: next(allocated),
        "reset_peak_memory_stats": lambda device=None: None,
        "max_memory_allocated": lambda device=None: 180 * MiB,
        "mem_get_info": lambda device=None: (700 * MiB, 1000 * MiB),
        "memory_reserved": lambda device=None: 150 * MiB,
        "empty_cache": lambda: None,
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    runner = ModelRunner(tiny_model_dir, num_kv_blocks=8, block_size=4, max_model_len=32)
    ran = []
    real_run = runner.run
    monkeypatch.setattr(runner, "run", lambda batch, **kw: ran.append(batch) or real_run(batch, **kw))
    baseline = CudaBaseline(free_bytes=900 * MiB, total_bytes=1000 * MiB, allocated_bytes=0, reserved_bytes=0)
    profile = measure_cuda_memory(runner, baseline, max_num_seqs=4, max_num_batched_tokens=64)
    assert profile == CudaMemoryProfile(
        total_bytes=1000 * MiB,
        free_at_start_bytes=900 * MiB,
        weights_bytes=100 * MiB,
        peak_activation_bytes=50 * MiB,
        non_torch_bytes=50 * MiB,  # 200 MiB more in use, 150 of it torch's
    )
    assert ran[0].query_lens == [16, 16, 16, 16]
    assert not hasattr(runner, "kv_pool")  # the scratch pool is gone; the real one is sized next


def test_a_budget_measured_with_the_weights_runs_a_forward_inside_the_constructor(tiny_model_dir):
    """The CUDA sizing runs a forward from inside `ModelRunner.__init__`, after the weights load and
    before the pool exists (found on an H200: `run` read an attribute set only at the end of the
    constructor). A CPU stand-in with the same protocol runs a real forward at that point."""
    from pdserve.engine.cuda_memory import profile_batch
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.kv_sizing import KvMemory

    class ProfiledOnCpu(KvMemory):
        needs_weights = True

        def budget_bytes(self, runner, bytes_per_token):
            batch = profile_batch(2, 16, runner.max_model_len, runner.block_size)
            start, end = runner.layer_range
            blocks = sum(len(t) for t in batch.block_tables)
            runner.kv_pool = KVPool(
                runner.local_config, end - start, runner.block_size, runner.dtype, runner.device, num_blocks=blocks
            )
            logits = runner.run(batch)
            assert logits.shape[0] == 2
            del runner.kv_pool
            return 6 * bytes_per_token * runner.block_size

    runner = ModelRunner(tiny_model_dir, block_size=4, max_model_len=16, kv_memory=ProfiledOnCpu())
    assert runner.kv_pool.num_blocks == 6
