"""TD-Pipe caps each prefill phase's batches where the cost table says the phase ends soonest
(td_scheduler.sized_prefill_batches): the largest batch fills and drains the pipeline."""

from __future__ import annotations

import random

from tdpipe.config import InstanceConfig, TDPipeOptions
from tdpipe.cost_table import CostTable
from tdpipe.td_scheduler import TDPipeScheduler, batch_tokens, greedy_batches, sized_prefill_batches
from tdpipe.workload import WorkloadConfig, generate

CPU_LIKE = CostTable("cpu-like", (1, 64, 2048), (40.0, 80.0, 2048.0))
"""A prefill's cost per token flat from 64 tokens (a CPU: no fixed cost to amortise)."""


def test_greedy_batches_keep_prompts_whole_and_in_order() -> None:
    assert greedy_batches([500] * 10, 2048) == [4, 4, 2]
    assert greedy_batches([3000, 10, 10], 2048) == [1, 2]  # a prompt over the cap is a batch alone
    assert greedy_batches([], 2048) == []
    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.randint(1, 1500) for _ in range(rng.randint(1, 30))]
        cap = rng.choice([256, 1024, 2048])
        sizes = greedy_batches(lens, cap)
        tokens = batch_tokens(lens, sizes)
        assert sum(sizes) == len(lens)
        assert all(n == 1 or t <= cap for n, t in zip(sizes, tokens))
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        assert all(t + lens[s] > cap for t, s in zip(tokens, starts[1:]))  # greedy: the next one did not fit


def test_a_flat_per_token_cost_takes_small_batches_and_a_fixed_cost_big_ones() -> None:
    lens = [250] * 32  # 8000 tokens
    small = sized_prefill_batches(lens, 2048, CPU_LIKE, 2)
    assert max(batch_tokens(lens, small)) <= 512  # two prompts a batch: the edge is one short batch
    # a GPU-like table (33 ms a forward, 0.2 ms a token): one-prompt batches would pay the fixed cost
    # 32 times; the phase is predicted shortest with 1000-token batches (8 x 116.5 ms + one to drain)
    big = sized_prefill_batches(lens, 2048, CostTable.analytic(), 2)
    assert batch_tokens(lens, big) == [1000] * 8
    assert sized_prefill_batches([], 2048, CPU_LIKE, 2) == []
    # one stage has no fill or drain: the full budget is never worse
    assert sized_prefill_batches(lens, 2048, CPU_LIKE, 1) == greedy_batches(lens, 2048)


def test_sized_batches_shorten_a_simulated_job_on_a_cpu_like_table() -> None:
    inst = InstanceConfig(num_stages=2, capacity_blocks=700, block_size=16, max_batch_tokens=2048)
    workload = WorkloadConfig(num_requests=64, max_input=1023, max_output=96, seed=0)
    runs = {}
    for sized in (False, True):
        reqs = generate(workload)  # fresh requests: a run consumes them
        runs[sized] = TDPipeScheduler(CPU_LIKE, inst, TDPipeOptions(size_prefill_batches=sized)).run(reqs)
        assert runs[sized].output_tokens == sum(r.output_len for r in reqs)
    assert runs[True].makespan_ms < runs[False].makespan_ms
    assert runs[True].bubble_ms < runs[False].bubble_ms
