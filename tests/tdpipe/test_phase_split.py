"""The phase split (tdpipe/runtime/stage_split.PipelineSplit): prefill batches on the equal layer
split, decode steps on the head-weighted one, and the layers two neighbouring stages both run
keep their KV in memory both map (tdpipe/runtime/shared_kv)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tiny_model import SIZES, make_tiny_model
from pdserve.tdpipe.runtime import shared_kv
from pdserve.tdpipe.config import InstanceConfig
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import SimExecutor
from pdserve.tdpipe.runtime.controller import PipeRequest
from pdserve.tdpipe.runtime.local import run_local_pipeline
from pdserve.tdpipe.runtime.profile_cache import cache_key
from pdserve.tdpipe.runtime.stage_split import lm_head_layers, pipeline_split, resolve_phase_split
from pdserve.tdpipe.runtime.stage_worker import StageConfig
from pdserve.tdpipe.simulator import make_policy
from pdserve.tdpipe.td_scheduler import MIN_CHUNK
from pdserve.tdpipe.workload import SimRequest
from tests.tdpipe.batch_helpers import batch_cmd, read_results, request_line, texts_by_id

PROMPTS = ["The old lighthouse keeper", "Once upon a time", "A quick brown fox", "Water is", "She opened the door and"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def wide_head_dir(tmp_path_factory) -> Path:
    """`tiny` with an 8192-token vocabulary: its LM head costs more than a layer, so 2 stages split
    a decode step 3 + 1 layers and a prefill 2 + 2: stage 1 runs layer 2 for prefills, stage 0 for
    decode steps."""
    return make_tiny_model(tmp_path_factory.mktemp("wide-head"), "tiny", vocab_size=8192)


@pytest.fixture(scope="module")
def expected(wide_head_dir) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(wide_head_dir)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [llm.tokenizer.encode(p) for p in PROMPTS], [list(o.outputs[0].token_ids) for o in outs]


def test_bench_prefills_on_the_equal_split_and_decodes_on_the_weighted_one() -> None:
    cfg = ModelConfig.from_dict({**SIZES["bench"], "architectures": ["LlamaForCausalLM"]})
    split = pipeline_split(cfg, 2, by_phase=True)
    assert split.by_phase
    assert split.decode == ((0, 8), (8, 12)) and split.prefill == ((0, 6), (6, 12))
    assert [split.held(k) for k in range(2)] == [(0, 8), (6, 12)]  # layers 6 and 7 on both
    assert split.span(1, decode_only=True) == (8, 12) and split.span(1, decode_only=False) == (6, 12)
    # three stages: every stage holds both of its ranges, contiguously
    three = pipeline_split(cfg, 3, by_phase=True)
    for k in range(3):
        lo, hi = three.held(k)
        assert lo <= min(three.decode[k][0], three.prefill[k][0]) and hi >= max(three.decode[k][1], three.prefill[k][1])
    fixed = pipeline_split(cfg, 2)
    assert not fixed.by_phase and fixed.prefill == fixed.decode == split.decode
    assert [fixed.held(k) for k in range(2)] == list(fixed.decode)


def test_a_split_that_does_not_move_layers_shares_nothing(tiny_model_dir, wide_head_dir) -> None:
    tiny = ModelConfig.from_dir(tiny_model_dir)
    assert lm_head_layers(tiny) < 1 and not pipeline_split(tiny, 2, by_phase=True).by_phase
    wide = ModelConfig.from_dir(wide_head_dir)
    assert lm_head_layers(wide) > 1
    split = pipeline_split(wide, 2, by_phase=True)
    assert split.decode == ((0, 3), (3, 4)) and split.prefill == ((0, 2), (2, 4))


def test_auto_is_on_only_where_the_stages_can_share_memory() -> None:
    assert resolve_phase_split("auto", "cpu", 1, external=False) is shared_kv.available()
    assert resolve_phase_split("off", "cpu", 1, external=False) is False
    for device, tp, external, why in [
        ("cpu", 1, True, "--external-stages"),
        ("cuda", 1, False, "cuda"),
        ("cpu", 2, False, "tensor-parallel"),
    ]:
        assert resolve_phase_split("auto", device, tp, external) is False
        with pytest.raises(ValueError, match=why):
            resolve_phase_split("on", device, tp, external)
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve_phase_split("sometimes", "cpu", 1, external=False)


def test_a_runner_runs_a_sub_range_of_its_layers(tiny_model_dir) -> None:
    """Layers 0-1 then 2-3 give what one run over 0-3 gives, on one pool (the second call reads the
    KV the first did not write, and writes its own)."""
    whole = ModelRunner(tiny_model_dir, num_kv_blocks=16, block_size=4, attention_backend="torch")
    parts = ModelRunner(tiny_model_dir, num_kv_blocks=16, block_size=4, attention_backend="torch")
    prompt = ForwardBatch(["a"], list(range(20, 31)), [11], [11], [[0, 1, 2]], [True])
    step = ForwardBatch(["a"], [40], [1], [12], [[0, 1, 2]], [True])
    for batch in (prompt, step):
        want = whole.run(batch)
        hidden = parts.run(batch, layers=(0, 2))
        assert hidden.shape == (batch.num_tokens, whole.model_config.hidden_size)
        got = parts.run(batch, layers=(2, 4), hidden_states=hidden)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(parts.kv_pool.tensor, whole.kv_pool.tensor, rtol=1e-5, atol=1e-5)
    stage = ModelRunner(tiny_model_dir, num_kv_blocks=16, block_size=4, attention_backend="torch", layer_range=(1, 3))
    for bad in [(0, 2), (2, 4), (2, 2)]:
        with pytest.raises(ValueError, match="outside"):
            stage.run(step, layers=bad, hidden_states=hidden)


def test_a_pool_over_the_callers_tensor_must_have_its_shape(tiny_model_dir) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    shape = (2, 5, 2, cfg.num_key_value_heads, 4, cfg.head_dim)
    memory = torch.zeros(shape)
    pool = KVPool(cfg, 2, 4, torch.float32, torch.device("cpu"), tensor=memory)
    assert pool.num_blocks == 5 and pool.tensor.data_ptr() == memory.data_ptr()
    for wrong in [torch.zeros(3, *shape[1:]), torch.zeros(shape, dtype=torch.bfloat16), memory.transpose(0, 1)]:
        with pytest.raises(ValueError, match="KV tensor"):
            KVPool(cfg, 2, 4, torch.float32, torch.device("cpu"), tensor=wrong)


@pytest.mark.skipif(not shared_kv.available(), reason="needs memfd_create")
def test_a_stage_process_writes_kv_the_launcher_reads(tiny_model_dir) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir)
    fd = shared_kv.create(cfg, 6, 4, torch.float32)
    try:
        mine = shared_kv.map_layers(fd, cfg, 6, 4, torch.float32, (0, 4))
        child = (
            "import sys, torch; from pdserve.engine.model_config import ModelConfig; "
            "from pdserve.tdpipe.runtime import shared_kv; "
            f"t = shared_kv.map_layers({fd}, ModelConfig.from_dir(sys.argv[1]), 6, 4, torch.float32, (2, 4)); "
            "t[0, 5, 1].fill_(7.0)"
        )
        subprocess.run([sys.executable, "-c", child, str(tiny_model_dir)], pass_fds=(fd,), check=True, timeout=120)
        assert torch.all(mine[2, 5, 1] == 7.0)  # the child's layer 0 is layer 2 of the file
        assert int(torch.count_nonzero(mine)) == mine[2, 5, 1].numel()
        with pytest.raises(ValueError, match="holds"):  # another block count than the file's
            shared_kv.map_layers(fd, cfg, 7, 4, torch.float32, (0, 4))
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="shared KV file"):
        shared_kv.map_layers(-1, cfg, 6, 4, torch.float32, (0, 4))


@pytest.mark.skipif(not shared_kv.available(), reason="needs memfd_create")
@pytest.mark.parametrize("policy", ["tdpipe", "pp-hb"])
def test_phase_split_pipeline_equals_llm(wide_head_dir, expected, policy) -> None:
    """Greedy tokens on 2 stages that run layer 2 by phase equal engine.LLM's, through recompute
    preemption (18 blocks of 4 tokens cannot hold 5 prompts and their 16 tokens each) and, under
    PP+HB with an 8-token budget, prompts chunked over batches that mix prompts and decode steps."""
    assert pipeline_split(ModelConfig.from_dir(wide_head_dir), 2, by_phase=True).by_phase
    prompts, outputs = expected
    reqs = [PipeRequest(f"r{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]
    cfg = StageConfig(str(wide_head_dir), num_kv_blocks=18, block_size=4, phase_split=True)
    decisions: list = []
    stats, timelines = run_local_pipeline(cfg, 2, reqs, 8, policy=policy, decisions=decisions)
    assert [r.output_ids for r in reqs] == outputs
    assert all(not r.block_ids for r in reqs)
    assert stats.num_preemptions > 0
    assert {p for tl in timelines for *_, p in tl} == {"prefill", "decode"}
    if policy == "pp-hb":
        assert any(n > 1 and not sample for _, items in decisions for _, n, sample in items)  # a non-final chunk


LONG_PROMPTS = [
    " ".join(["The old lighthouse keeper climbed the stairs at dusk"] * 6),
    " ".join(["Once upon a time a river ran through the quiet valley"] * 4),
    "Water is",
    " ".join(["She opened the door and saw the garden in the rain"] * 5),
]


@pytest.mark.skipif(not shared_kv.available(), reason="needs memfd_create")
def test_tdpipe_chunks_prompts_across_prefill_batches_in_flight_together(wide_head_dir) -> None:
    """TD-Pipe submits a whole prefill phase at once, so one prompt's chunks are in the pipeline
    together: the controller must send each chunk the positions after the previous one (not after
    what has come back), and each chunk must run on the prefill split like the ones before it (a
    piece is never under MIN_CHUNK tokens, so no batch that continues a prompt is decode-only).
    Greedy tokens equal engine.LLM's, and the decisions equal the simulator's."""
    llm = LLM(wide_head_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(LONG_PROMPTS, params)]
    prompts = [llm.tokenizer.encode(p) for p in LONG_PROMPTS]
    del llm
    reqs = [PipeRequest(f"r{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]
    budget = 48  # under the longest prompt: it is split, and every batch but the last is full
    assert max(map(len, prompts)) > budget
    cfg = StageConfig(str(wide_head_dir), num_kv_blocks=200, block_size=4, phase_split=True)
    # a CPU's prefill cost, flat per token: the batches take the full budget (the analytic GPU-like
    # table's fixed cost per forward would rather keep the four prompts whole, one per batch)
    table = CostTable("cpu-like", (1, 64, 2048), (40.0, 80.0, 2048.0))
    decisions: list = []
    stats, _ = run_local_pipeline(cfg, 2, reqs, budget, policy="tdpipe", table=table, decisions=decisions)
    assert [r.output_ids for r in reqs] == expected
    assert all(not r.block_ids for r in reqs)
    prefills = [items for phase, items in decisions if phase == "prefill"]
    pieces: dict[str, list[tuple[int, bool]]] = {}
    for items in prefills:
        for rid, n, sample in items:
            pieces.setdefault(rid, []).append((n, sample))
    split = [p for p in pieces.values() if len(p) > 1]
    assert split and all(n >= MIN_CHUNK for p in split for n, _ in p)
    assert all([s for _, s in p] == [False] * (len(p) - 1) + [True] for p in pieces.values())
    sim_reqs = [SimRequest(f"r{i}", len(p), MAX_TOKENS, MAX_TOKENS) for i, p in enumerate(prompts)]  # type: ignore[arg-type]
    inst = InstanceConfig(num_stages=2, capacity_blocks=200, block_size=4, max_batch_tokens=budget)
    sim = SimExecutor(table, 2)
    make_policy("tdpipe", table, inst).run(sim_reqs, sim)
    assert sim.decisions == decisions
    assert stats.output_tokens == MAX_TOKENS * len(reqs)


def test_the_profile_cache_keys_each_phase_split(wide_head_dir) -> None:
    fixed, by_phase = cache_key(wide_head_dir, 2, {}), cache_key(wide_head_dir, 2, {"phase_split": True})
    assert fixed["layer_ranges"] == by_phase["layer_ranges"] == [[0, 3], [3, 4]]
    assert fixed["prefill_layer_ranges"] == [[0, 3], [3, 4]] and by_phase["prefill_layer_ranges"] == [[0, 2], [2, 4]]


def test_batch_refuses_a_phase_split_it_cannot_run(tmp_path, tiny_model_dir) -> None:
    (tmp_path / "in.jsonl").write_text(request_line("r0", "Hello") + "\n")
    cmd = batch_cmd(tmp_path, "--model", str(tiny_model_dir), "--phase-split", "on", "--tensor-parallel-size", "2")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--phase-split on" in done.stderr
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


@pytest.mark.skipif(not shared_kv.available(), reason="needs memfd_create")
def test_batch_job_splits_by_phase_by_default(tmp_path, wide_head_dir) -> None:
    """`pdserve batch` with its defaults on the wide-head model: the profile and the stages run
    the phase split, and the texts are engine.LLM's."""
    lines = [request_line(f"r{i}", p, max_tokens=MAX_TOKENS) for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    cmd = batch_cmd(tmp_path, "--model", str(wide_head_dir), "--stats", str(tmp_path / "stats.json"))
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PDSERVE_CACHE_DIR=str(tmp_path))
    )
    assert done.returncode == 0, done.stderr
    want = LLM(wide_head_dir).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert texts_by_id(read_results(tmp_path / "out.jsonl")) == {f"r{i}": o.outputs[0].text for i, o in enumerate(want)}
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["phase_split"] is True and stats["completed"] == len(PROMPTS)


def test_the_profile_times_each_phase_on_its_split(wide_head_dir) -> None:
    from pdserve.tdpipe.runtime.profile import profile_stages

    options = dict(decode_batches=[1, 4], prefill_tokens=[16, 64], decode_context=16, block_size=4, repeats=1)
    by_phase = profile_stages(wide_head_dir, 2, phase_split=True, attention_backend="torch", **options)
    assert [p.layer_range for p in by_phase] == [(0, 3), (2, 4)]  # each holds both of its ranges
    fixed = profile_stages(wide_head_dir, 2, attention_backend="torch", **options)
    assert [p.layer_range for p in fixed] == [(0, 3), (3, 4)]
    for p in by_phase + fixed:
        assert sorted(p.decode_ms) == [1, 4] and sorted(p.prefill_ms) == [16, 64]


@pytest.mark.slow
@pytest.mark.skipif(not shared_kv.available(), reason="needs memfd_create")
def test_three_bench_stages_whose_middle_shares_layers_with_both_neighbours() -> None:
    """bench on 3 stages: decode 0-5 / 6-10 / 11, prefill 0-3 / 4-7 / 8-11, so the middle stage
    holds 4-10 and shares layers 4-5 with stage 0 and 8-10 with stage 2."""
    import random

    from pdserve.engine.builtin import default_model_dir

    model_dir = str(default_model_dir("bench"))
    split = pipeline_split(ModelConfig.from_dir(model_dir), 3, by_phase=True)
    assert [split.held(k) for k in range(3)] == [(0, 6), (4, 11), (8, 12)]
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 30000) for _ in range(rng.randrange(20, 200))] for _ in range(6)]
    outs = LLM(model_dir, num_kv_blocks=400).generate(
        prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    for policy in ("tdpipe", "pp-hb"):
        reqs = [PipeRequest(f"r{i}", p, 10) for i, p in enumerate(prompts)]
        cfg = StageConfig(model_dir, num_kv_blocks=60, block_size=16, phase_split=True)
        run_local_pipeline(cfg, 3, reqs, 256, policy=policy)
        assert [r.output_ids for r in reqs] == [list(o.outputs[0].token_ids) for o in outs], policy


def test_the_stage_command_carries_the_phase_split_and_the_shared_file() -> None:
    """The launcher's flags reach `pdserve stage` as its parser reads them (a stage that missed the
    switch would run the fixed split on a private pool, and still answer right)."""
    from pdserve.cli import build_parser
    from pdserve.tdpipe.runtime.local import stage_command

    for phase_split in (True, False):
        cmd = stage_command(StageConfig("/m", num_kv_blocks=8, phase_split=phase_split, kv_fd=7))
        args = build_parser().parse_args(cmd[cmd.index("stage") :])
        assert args.phase_split is phase_split and args.kv_fd == 7
