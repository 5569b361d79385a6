"""Tensor parallelism (engine.parallel): the sharding rules, the sharded load, two ranks' logits
equal one rank's, and the death of any rank ends every rank with a clear error, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.group import RankFailure, TPGroup, rendezvous
from pdserve.engine.parallel.sharding import TPShard, kv_head_range
from pdserve.engine.weights import load_tensors
from tests.e2e.cluster import ROOT


def _config(tiny_model_dir, **overrides) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(ModelConfig.from_dir(tiny_model_dir), **overrides)


def test_kv_heads_split_or_replicated():
    assert [kv_head_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]


def test_unsplittable_models_are_refused(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)  # 4 heads, 2 KV heads, MLP 384
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        TPShard(0, 3).check(cfg)
    with pytest.raises(ValueError, match="KV heads"):
        TPShard(0, 2).check(_config(tiny_model_dir, num_attention_heads=6, num_key_value_heads=3))
    with pytest.raises(ValueError, match="intermediate_size"):
        TPShard(0, 4).check(_config(tiny_model_dir, intermediate_size=386))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_model_dir, tensor_parallel_size=0)


def test_rank_shards_reassemble_the_checkpoint(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    span = (0, cfg.num_hidden_layers)
    full = load_tensors(tiny_model_dir, cfg, span, torch.float32, torch.device("cpu"))
    parts = [load_tensors(tiny_model_dir, cfg, span, torch.float32, torch.device("cpu"), TPShard(r, 2)) for r in (0, 1)]
    for name, whole in full.items():
        cut = TPShard(0, 2).tensor_slice(name, cfg)
        if cut is None:
            assert all(torch.equal(p[name], whole) for p in parts), name
        else:
            assert parts[0][name].shape[cut[0]] == whole.shape[cut[0]] // 2, name
            assert torch.equal(torch.cat([p[name] for p in parts], dim=cut[0]), whole), name


def test_two_ranks_compute_the_logits_of_one(tiny_model_dir):
    """Two ranks in two threads of this process (two gloo groups over one store): the same logits,
    up to the summation order of the all-reduce."""
    batch = ForwardBatch(["a", "b"], list(range(5, 12)) + [40], [7, 1], [7, 1], [[0], [1]], [True, True])
    want = ModelRunner(tiny_model_dir, num_kv_blocks=8, block_size=8).run(batch)
    store = rendezvous(0, 2, 0, 60)
    got: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        group = TPGroup(r, 2, store if r == 0 else rendezvous(1, 2, store.port, 60), torch.device("cpu"), 60)
        runner = ModelRunner(tiny_model_dir, num_kv_blocks=8, block_size=8, tp=group)
        runner._drives_ranks = False  # both ranks are run by hand here
        assert runner.kv_pool.num_kv_heads == 1  # its share of the 2 KV heads
        got[r] = runner.run(batch)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert torch.allclose(got[0], want, atol=1e-5) and torch.equal(got[0], got[1])
    assert torch.equal(got[0].argmax(-1), want.argmax(-1))


def _gone(pid: int, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_dead_rank_fails_the_engine_at_once(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_kv_blocks=32, tensor_parallel_size=2)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
        (pid,) = llm.engine.runner.ranks.pids()
        os.kill(pid, signal.SIGKILL)
        assert _gone(pid, 10)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1"):
            for _ in range(50):  # the watcher notices within moments; check() then fails every call
                llm.engine.check_ranks()
                time.sleep(0.1)
        with pytest.raises(RankFailure):
            llm.generate([[5, 6, 7]], params)
        assert time.monotonic() - t0 < 10
    finally:
        llm.close()


RANK0 = """
import sys, time
from pdserve.engine import LLM
llm = LLM(sys.argv[1], num_kv_blocks=32, tensor_parallel_size=2)
print(*llm.engine.runner.ranks.pids(), flush=True)
time.sleep(600)
"""


def test_rank0_death_ends_the_other_ranks(tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", RANK0, str(tiny_model_dir)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 1
        proc.kill()  # SIGKILL: no cleanup runs in rank 0
        assert all(_gone(pid, 15) for pid in pids), "a rank outlived rank 0"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_generate_cli_is_the_same_at_tp2(tiny_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--model", str(tiny_model_dir), "--max-tokens", "16"]
    cmd += ["--prompt", "The old lighthouse keeper", "--prompt", "Once upon a time"]
    one = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    two = subprocess.run(cmd + ["--tensor-parallel-size", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and "16 tokens" in one.stdout
    bad = subprocess.run(cmd + ["--tensor-parallel-size", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "does not divide the 4 attention heads" in bad.stderr
