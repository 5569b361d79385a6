"""The decode-graph machinery (engine.cuda_graphs) on CPU, through a stand-in capture that replays
the captured forward eagerly on the graph's fixed buffers: bucketing, padding rows, the fixed-width
tables, the connector's hooks, the progress count and the fallbacks. The CUDA capture itself runs in
tests/gpu/test_cuda_graphs_gpu.py."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from pdserve.engine.cuda_graphs import CAPTURE_SIZES, DecodeGraphs, capture_sizes, graphs_unsupported
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_connector import KvConnector
from pdserve.engine.model_runner import ModelRunner
from tests.engine.factories import build_checkpoint

BLOCK = 4  # small pages, so that contexts span several blocks
SIZES = [1, 2, 4, 8]


def eager_replay_capture(forward):
    """Capture stand-in: the 'graph' reruns `forward` (which reads only the fixed buffers) and
    writes into the output tensor the capture returned, as a CUDA graph replay does."""
    out = forward()

    def replay() -> None:
        out.copy_(forward())

    return replay, out


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return build_checkpoint("mistral", tmp_path_factory.mktemp("graphs"), tiny_model_dir)  # a window of 32


def _runner(model_dir, graphs: bool) -> ModelRunner:
    runner = ModelRunner(
        model_dir, dtype="float32", attention_backend="torch", block_size=BLOCK, num_kv_blocks=160, max_model_len=200
    )
    if graphs:
        runner.graphs = DecodeGraphs(runner, SIZES, capture=eager_replay_capture)
        runner.graphs.capture_all()
    return runner


def _prefill_then_decode(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]]) -> list[torch.Tensor]:
    """Prefill each prompt, then 3 decode steps of the whole batch; the decode steps' logits."""
    out = []
    for i, (p, t) in enumerate(zip(prompts, tables)):
        runner.run(ForwardBatch([f"r{i}"], p, [len(p)], [len(p)], [t], [True]))
    lens = [len(p) for p in prompts]
    rng = random.Random(1)
    for _ in range(3):
        lens = [n + 1 for n in lens]
        ids = [rng.randrange(5, 1700) for _ in prompts]
        batch = ForwardBatch(
            [f"r{i}" for i in range(len(prompts))], ids, [1] * len(prompts), lens, tables, [True] * len(prompts)
        )
        out.append(runner.run(batch))
    return out


@pytest.mark.parametrize("n", [1, 3, 5, 8, 9])
def test_graph_steps_equal_eager_steps(model_dir, n):
    """Sizes on a bucket, between buckets (padded) and beyond the largest (eager): the same logits
    and the same pool, so padding rows wrote nothing anywhere else."""
    rng = random.Random(n)
    prompts = [[rng.randrange(5, 1700) for _ in range(rng.randrange(20, 60))] for _ in range(n)]
    tables = [list(range(17 * i + 1, 17 * i + 18)) for i in range(n)]  # block 0 never used by a sequence
    eager, graphs = _runner(model_dir, False), _runner(model_dir, True)
    expected = _prefill_then_decode(eager, prompts, tables)
    got = _prefill_then_decode(graphs, prompts, tables)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    # block 0 took the capture's writes at start, while the pool was still empty
    torch.testing.assert_close(graphs.kv_pool.tensor[:, 1:], eager.kv_pool.tensor[:, 1:], atol=1e-5, rtol=1e-5)
    assert graphs.graphs is not None and graphs.graphs.replays == (3 if n <= max(SIZES) else 0)
    assert graphs.progress == eager.progress  # capture and replay count each layer once per step


def test_unsampled_rows_are_left_out(model_dir):
    runner = _runner(model_dir, True)
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14]]
    tables = [[1, 2], [3, 4]]
    for i, (p, t) in enumerate(zip(prompts, tables)):
        runner.run(ForwardBatch([f"r{i}"], p, [len(p)], [len(p)], [t], [True]))
    batch = ForwardBatch(["r0", "r1"], [20, 21], [1, 1], [6, 4], tables, [False, True])
    assert runner.run(batch).shape[0] == 1


class RecordingConnector(KvConnector):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def start_load(self, batch):
        self.calls.append("start_load")

    def wait_for_layer(self, layer):
        self.calls.append(f"wait{layer}")

    def save_layer(self, layer, batch):
        self.calls.append(f"save{layer}")

    def wait_for_save(self):
        self.calls.append("wait_for_save")


def test_a_replay_waits_for_every_layer_before_and_saves_after(model_dir):
    runner = _runner(model_dir, True)
    runner.run(ForwardBatch(["r"], [5, 6, 7], [3], [3], [[1]], [True]))
    connector = RecordingConnector()
    runner.run(ForwardBatch(["r"], [8], [1], [4], [[1]], [True]), connector=connector)
    layers = runner.model_config.num_hidden_layers
    assert connector.calls == (
        ["start_load"] + [f"wait{i}" for i in range(layers)] + [f"save{i}" for i in range(layers)] + ["wait_for_save"]
    )
    assert runner.graphs is not None and runner.graphs.replays == 1


def test_a_failed_capture_leaves_the_runner_eager(model_dir, caplog):
    runner = _runner(model_dir, False)
    calls = []

    def failing(forward):
        calls.append(1)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return eager_replay_capture(forward)

    runner._graph_sizes = SIZES
    runner.graphs = DecodeGraphs(runner, SIZES, capture=failing)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        runner.graphs.capture_all()
    assert not runner.graphs.captured  # nothing half-captured is kept

    import pdserve.engine.model_runner as mr

    original = mr.DecodeGraphs
    mr.DecodeGraphs = lambda r, sizes: original(r, sizes, capture=failing)  # type: ignore[assignment]
    try:
        calls.clear()
        with caplog.at_level(logging.WARNING):
            assert runner._captured_graphs(SIZES) is None
    finally:
        mr.DecodeGraphs = original  # type: ignore[assignment]
    assert "CUDA graphs off: capture failed (OutOfMemoryError" in caplog.text
    assert runner._graph_sizes is None  # the trial's failure keeps the real capture from being tried
    runner.graphs = None
    batch = ForwardBatch(["r"], [5, 6, 7], [3], [3], [[1]], [True])
    assert runner.run(batch).shape == (1, runner.model_config.vocab_size)


def test_capture_sizes():
    assert capture_sizes(256) == list(CAPTURE_SIZES)
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]
    assert capture_sizes(1000) == list(CAPTURE_SIZES)  # larger batches run eager


def test_graphs_are_only_for_cuda_engines_that_can_replay(model_dir):
    runner = _runner(model_dir, False)
    assert graphs_unsupported(runner) == "not on CUDA"
    assert runner.graphs is None  # a CPU engine never captures
