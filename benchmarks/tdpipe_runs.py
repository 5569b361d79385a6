"""The runs `benchmarks/tdpipe_runtime.py` compares, on one workload: engine.LLM in one process, the
real 2-stage pipeline under a policy, and the simulator's run of the same policy object."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.tdpipe.config import InstanceConfig
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import SimExecutor
from pdserve.tdpipe.pipeline import SimStats
from pdserve.tdpipe.runtime.timeline import bubble_fraction, job_span
from pdserve.tdpipe.simulator import make_policy
from pdserve.tdpipe.workload import SimRequest, WorkloadConfig, generate

NUM_STAGES = 2
BLOCK_SIZE = 16


@dataclass(frozen=True)
class BenchRequest:
    """One request of the job: its prompt, its true output length (max_tokens with ignore_eos: where
    its answer ends) and the length the schedulers plan it on."""

    request_id: int
    prompt_ids: list[int]
    output_len: int
    predicted_len: int
    """What the policies admit and plan on: the workload's bucket predictor (`tdpipe.workload`, 55%
    of predictions in the true length's bucket, the paper's accuracy), or `output_len` under
    `exact_lengths`."""


def build_workload(
    num: int, max_input: int, max_output: int, vocab: int, seed: int = 0, exact_lengths: bool = False
) -> list[BenchRequest]:
    """ShareGPT-like lengths (pdserve.tdpipe.workload) with deterministic random ids in [10, vocab);
    each planned on the workload's predicted length, or on its true one with `exact_lengths` (a
    perfect predictor, which no real job has)."""
    lengths = generate(WorkloadConfig(num_requests=num, max_input=max_input, max_output=max_output, seed=seed))
    rng = random.Random(seed + 1)
    return [
        BenchRequest(
            r.request_id,
            [rng.randrange(10, vocab) for _ in range(r.input_len)],
            r.output_len,
            r.output_len if exact_lengths else r.predicted_len,
        )
        for r in lengths
    ]


def run_llm(model_dir: Path, reqs: list[BenchRequest], kv_blocks: int, threads: int, max_batch_tokens: int) -> dict:
    """engine.LLM's engine in this process: same requests, same KV tokens, 2 threads."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(
        model_dir,
        num_threads=threads,
        num_kv_blocks=kv_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=max(256, len(reqs)),
        max_num_batched_tokens=max_batch_tokens,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    engine.runner.attention.wait_ready()  # a first-use kernel build is not part of the measurement
    for r in reqs:
        engine.add_request(
            str(r.request_id), r.prompt_ids, SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        )
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    del llm, engine
    return {"output_tokens": produced, "seconds": seconds, "tok_s": produced / seconds}


def run_pipeline(
    model_dir: Path,
    reqs: list[BenchRequest],
    kv_blocks: int,
    policy: str,
    max_batch_tokens: int,
    table: CostTable,
    phase_split: bool = False,
) -> dict:
    """One job through 2 local stage processes (1 thread each) under `policy`; TD-Pipe's switch
    decisions read `table`, the same profiled table the simulator runs on. `phase_split`: prefill
    batches on the equal layer split (tdpipe.runtime.stage_split.PipelineSplit)."""
    from pdserve.tdpipe.runtime.controller import PipeRequest
    from pdserve.tdpipe.runtime.local import run_local_pipeline
    from pdserve.tdpipe.runtime.stage_worker import StageConfig

    cfg = StageConfig(
        str(model_dir), num_kv_blocks=kv_blocks, block_size=BLOCK_SIZE, num_threads=1, phase_split=phase_split
    )
    # max_tokens = the true length ends the answer there (ignore_eos); the policy plans on predicted_len
    pipe_reqs = [
        PipeRequest(str(r.request_id), list(r.prompt_ids), r.output_len, predicted_len=r.predicted_len) for r in reqs
    ]
    decisions: list = []
    stats, timelines = run_local_pipeline(
        cfg, NUM_STAGES, pipe_reqs, max_batch_tokens, policy=policy, table=table, decisions=decisions
    )
    produced = sum(len(r.output_ids) for r in pipe_reqs)
    expected = sum(r.output_len for r in reqs)
    assert produced == expected, f"{policy}: {produced} output tokens != {expected}"
    t0, t1 = job_span(timelines)
    decode_sizes = [n for tl in timelines for _, _, n, p in tl if p == "decode"]
    return {
        "output_tokens": produced,
        "seconds": t1 - t0,
        "tok_s": produced / (t1 - t0),
        "bubble": bubble_fraction(timelines),
        "phase_switches": len(stats.phase_switches),
        "preemptions": stats.num_preemptions,
        "batches": len(decisions),
        "decisions": decisions,
        "max_decode_batch": max(decode_sizes, default=0),
        "timelines": timelines,
    }


def predict(policy: str, table: CostTable, inst: InstanceConfig, reqs: list[BenchRequest]) -> tuple[SimStats, list]:
    """The simulator's run of `policy` (the same policy object the runtime runs) and its decision log."""
    executor = SimExecutor(table, inst.num_stages)
    stats = make_policy(policy, table, inst).run(sim_requests(reqs), executor)
    assert stats.output_tokens == sum(r.output_len for r in reqs), f"{policy}: simulated token count"
    return stats, executor.decisions


def sim_requests(reqs: list[BenchRequest]) -> list[SimRequest]:
    """The workload for the simulator, planned on the same predicted lengths as the runtime."""
    return [SimRequest(r.request_id, len(r.prompt_ids), r.output_len, r.predicted_len) for r in reqs]
