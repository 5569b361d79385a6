"""TD-Pipe stages as tensor-parallel groups: `pdserve batch --stages 2 --tensor-parallel-size 2` on the
tiny fp32 model answers with engine.LLM's greedy texts (one process, one stage, TP=1), and a SIGKILLed
rank ends its stage and the job at once (exit 1, the rank named), leaving no process behind.

Four rank processes on a 2-core machine: the jobs take a minute, hence `slow`. Stores listen on
127.0.0.1 only; every test stops what it started and polls with deadlines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.parallel.launcher import TensorParallelRunner
from pdserve.tdpipe.runtime.stage_worker import StageConfig, stage_device
from tests.tdpipe.batch_helpers import (
    PROMPTS,
    START_TIMEOUT,
    STOP_TIMEOUT,
    all_gone,
    batch_cmd,
    children_with,
    kill_job,
    read_results,
    request_line,
    stage_pids,
    start_stage_ranks,
    texts_by_id,
)

TP_FLAGS = ("--stages", "2", "--tensor-parallel-size", "2", "--dtype", "float32", "--cost-table", "analytic")


def _rank_pids(stage_pid: int, deadline: float) -> list[int]:
    """The tensor-parallel rank processes (pdserve.engine.parallel.worker) a `pdserve stage` started."""
    while time.monotonic() < deadline:
        kids = children_with(stage_pid, "pdserve.engine.parallel.worker")
        if kids:
            return kids
        time.sleep(0.1)
    raise AssertionError(f"stage {stage_pid} started no tensor-parallel rank")


def test_stage_config_carries_the_group_size_to_the_stage_command() -> None:
    from pdserve.tdpipe.runtime.local import stage_command

    cmd = stage_command(StageConfig("/m", num_kv_blocks=8, tensor_parallel_size=2))
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    # a stage may now be a layer slice split over ranks
    assert EngineConfig("/m", layer_range=(0, 1), tensor_parallel_size=2).layer_range == (0, 1)


def test_a_later_stage_split_over_two_ranks_computes_the_whole_models_logits(tiny_model_dir) -> None:
    """Stage 0 unsplit, stage 1 over two ranks (a real worker process): rank 0 alone is handed the
    hidden states, as a pipeline stage is, and broadcasts them; the logits are the whole model's."""
    n = ModelConfig.from_dir(tiny_model_dir).num_hidden_layers
    batch = ForwardBatch(["a", "b"], list(range(5, 12)) + [40], [7, 1], [7, 1], [[0], [1]], [True, True])
    opts = dict(num_kv_blocks=8, block_size=8, dtype="float32")
    want = ModelRunner(tiny_model_dir, **opts).run(batch)
    hidden = ModelRunner(tiny_model_dir, layer_range=(0, n // 2), **opts).run(batch)
    threads = torch.get_num_threads()  # the TP runner sets this process's share of the cores
    deaths: list[str] = []
    engine = EngineConfig(tiny_model_dir, layer_range=(n // 2, n), tensor_parallel_size=2, **opts)
    last = TensorParallelRunner(engine, on_rank_death=deaths.append)
    try:
        assert last.local_config.num_key_value_heads == 1 and not last.is_first_stage
        got = last.run(batch, hidden_states=hidden)
        assert torch.allclose(got, want, atol=1e-5) and torch.equal(got.argmax(-1), want.argmax(-1))
        assert last.ranks.dead is None
    finally:
        last.close()
        torch.set_num_threads(threads)
    assert all(p.poll() is not None for p in last.ranks.procs)
    time.sleep(0.5)  # the rank watcher thread has seen the exit by now
    assert not deaths, "a rank that exits on the stop step is not a death (it would end a finished stage)"


def test_bare_cuda_gives_each_stage_a_block_of_gpus(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert stage_device("cuda", 2, tensor_parallel_size=2) == "cuda:2"  # its ranks take cuda:2, cuda:3
    assert stage_device("cpu", 2, tensor_parallel_size=2) == "cpu"
    assert stage_device("cuda:1", 2, tensor_parallel_size=4) == "cuda:1"


def test_batch_refuses_a_size_the_model_cannot_split(tmp_path, capsys) -> None:
    from pdserve.cli import main

    (tmp_path / "in.jsonl").write_text(request_line("a", "x") + "\n")
    assert main(batch_cmd(tmp_path, "--tensor-parallel-size", "3")[3:]) == 2
    assert "tensor-parallel size 3 does not divide" in capsys.readouterr().err
    assert main(batch_cmd(tmp_path, "--tensor-parallel-size", "-1")[3:]) == 2
    assert "--tensor-parallel-size must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.slow  # 40-90 s: five processes loading the tiny model on two cores
def test_two_stages_of_two_ranks_equal_one_process(tmp_path, batch_expected) -> None:
    (tmp_path / "in.jsonl").write_text("\n".join(request_line(f"r{i}", p) for i, p in enumerate(PROMPTS)) + "\n")
    done = subprocess.run(batch_cmd(tmp_path, *TP_FLAGS), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tensor-parallel rank" not in done.stderr, done.stderr  # the ranks stopped, none died
    assert texts_by_id(read_results(tmp_path / "out.jsonl")) == batch_expected


@pytest.mark.slow  # 40-90 s: as above
def test_external_tp_stages_configured_from_the_environment(tmp_path, tiny_model_dir, batch_expected) -> None:
    """The offline overlay's way: `pdserve stage` pods given PDSERVE_TENSOR_PARALLEL_SIZE=2 (ConfigMap),
    `pdserve batch --external-stages` as rank 0; the stages stop cleanly (exit 0) at the end."""
    (tmp_path / "in.jsonl").write_text("\n".join(request_line(f"r{i}", p) for i, p in enumerate(PROMPTS)) + "\n")
    env, stages = start_stage_ranks(tiny_model_dir, PDSERVE_TENSOR_PARALLEL_SIZE="2")
    try:
        cmd = batch_cmd(tmp_path, "--external-stages", "--model", str(tiny_model_dir), "--dtype", "float32")
        env = {k: v for k, v in env.items() if k != "PDSERVE_TENSOR_PARALLEL_SIZE"}  # the controller has no ranks
        done = subprocess.run(cmd, env=dict(env, RANK="0"), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert [s.wait(timeout=STOP_TIMEOUT) for s in stages] == [0, 0]
    finally:
        for s in stages:
            if s.poll() is None:
                s.kill()
                s.wait()
    assert texts_by_id(read_results(tmp_path / "out.jsonl")) == batch_expected


@pytest.mark.slow  # 30-60 s: as above, stopped part way
def test_a_killed_rank_fails_the_job_clearly_and_leaves_nothing(tmp_path) -> None:
    # long requests: the job is still running when the rank is killed
    lines = [request_line(f"r{i}", p, max_tokens=400) for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    cmd = batch_cmd(tmp_path, *TP_FLAGS, "--num-kv-blocks", "1024")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    everyone: list[int] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT
        stages = stage_pids(proc.pid, 2, deadline)
        ranks = {s: _rank_pids(s, deadline) for s in stages}
        everyone = stages + [r for rs in ranks.values() for r in rs]
        victim = ranks[stages[1]][0]
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=STOP_TIMEOUT)
        assert proc.returncode == 1, err
        assert f"tensor-parallel rank 1 (pid {victim})" in err, err
        assert "pipeline stage died" in err, err
        assert all_gone(everyone, time.monotonic() + STOP_TIMEOUT), "a stage or rank outlived the failed job"
    finally:
        kill_job(proc)
        for pid in everyone:  # a failure above must not leave ranks behind on the CI machine
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
