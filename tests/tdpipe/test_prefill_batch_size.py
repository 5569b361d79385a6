"""TD-Pipe packs each prefill phase's prompts into batches (td_scheduler.pack_prompts) and caps them
where the cost table says the phase ends soonest (sized_prefill_batches): the largest batch fills
and drains the pipeline. Chunked packing splits a prompt across batches so that its length no
longer bounds the largest batch."""

from __future__ import annotations

import random

import pytest

from pdserve.tdpipe.config import InstanceConfig, TDPipeOptions
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import SimExecutor
from pdserve.tdpipe.td_scheduler import MIN_CHUNK, TDPipeScheduler, batch_tokens, pack_prompts, sized_prefill_batches
from pdserve.tdpipe.workload import WorkloadConfig, generate

CPU_LIKE = CostTable("cpu-like", (1, 64, 2048), (40.0, 80.0, 2048.0))
"""A prefill's cost per token flat from 64 tokens (a CPU: no fixed cost to amortise)."""


def _pieces(batches: list[list[tuple[int, int]]]) -> dict[int, list[int]]:
    """Prompt index -> the sizes of its pieces, in batch order."""
    pieces: dict[int, list[int]] = {}
    for b in batches:
        for i, n in b:
            pieces.setdefault(i, []).append(n)
    return pieces


def test_whole_prompts_keep_their_order_and_fill_greedily() -> None:
    assert [len(b) for b in pack_prompts([500] * 10, 2048)] == [4, 4, 2]
    assert pack_prompts([3000, 10, 10], 2048) == [[(0, 3000)], [(1, 10), (2, 10)]]  # over the cap: alone
    assert pack_prompts([], 2048) == [] and pack_prompts([], 2048, chunk=True) == []
    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.randint(1, 1500) for _ in range(rng.randint(1, 30))]
        cap = rng.choice([256, 1024, 2048])
        batches = pack_prompts(lens, cap)
        assert [i for b in batches for i, _ in b] == list(range(len(lens)))
        assert all(n == lens[i] for b in batches for i, n in b)  # whole
        tokens = batch_tokens(batches)
        assert all(len(b) == 1 or t <= cap for b, t in zip(batches, tokens))
        assert all(t + lens[b[0][0]] > cap for t, b in zip(tokens, batches[1:]))  # greedy: the next did not fit


def test_chunked_packing_fills_every_batch_and_never_cuts_a_sliver() -> None:
    assert pack_prompts([300, 1023, 40], 512, chunk=True) == [[(0, 300), (1, 212)], [(1, 512)], [(1, 299), (2, 40)]]
    # a piece would be shorter than MIN_CHUNK: the split moves, or the prompt starts the next batch
    assert pack_prompts([500, 30], 512, chunk=True) == [[(0, 500)], [(1, 30)]]
    assert pack_prompts([500, 40], 512, chunk=True) == [[(0, 500)], [(1, 40)]]  # 12 tokens of room: no piece
    assert pack_prompts([490, 40], 512, chunk=True) == [[(0, 490), (1, 22)], [(1, 18)]]
    assert pack_prompts([490, 30], 512, chunk=True) == [[(0, 490)], [(1, 30)]]  # a 22 + 8 split would cut a sliver
    # below two MIN_CHUNKs a cap keeps prompts whole
    assert pack_prompts([100, 100], 2 * MIN_CHUNK - 1, chunk=True) == pack_prompts([100, 100], 2 * MIN_CHUNK - 1)
    rng = random.Random(1)
    for _ in range(2000):
        lens = [rng.choice([1, 15, 16, 17, 33, rng.randint(1, 3000)]) for _ in range(rng.randint(1, 12))]
        cap = rng.choice([32, 33, 64, 100, 512, 2048])
        batches = pack_prompts(lens, cap, chunk=True)
        pieces = _pieces(batches)
        assert [i for b in batches for i, _ in b] == sorted(i for b in batches for i, _ in b)  # in order
        assert {i: sum(p) for i, p in pieces.items()} == dict(enumerate(lens))  # every token once
        assert all(min(p) >= MIN_CHUNK for p in pieces.values() if len(p) > 1)
        tokens = batch_tokens(batches)
        assert max(tokens) <= cap or max(lens) <= 0
        assert all(t > cap - 2 * MIN_CHUNK for t in tokens[:-1])  # full but for slivers it would not cut


def test_a_flat_per_token_cost_takes_small_batches_and_a_fixed_cost_big_ones() -> None:
    lens = [250] * 32  # 8000 tokens
    small = sized_prefill_batches(lens, 2048, CPU_LIKE, 2)
    assert max(batch_tokens(small)) <= 512  # two prompts a batch: the edge is one short batch
    # a GPU-like table (33 ms a forward, 0.2 ms a token): one-prompt batches would pay the fixed cost
    # 32 times; the phase is predicted shortest with 1000-token batches (8 x 116.5 ms + one to drain)
    big = sized_prefill_batches(lens, 2048, CostTable.analytic(), 2)
    assert batch_tokens(big) == [1000] * 8
    assert sized_prefill_batches([], 2048, CPU_LIKE, 2) == []
    # one stage has no fill or drain: the full budget is never worse
    assert sized_prefill_batches(lens, 2048, CPU_LIKE, 1) == pack_prompts(lens, 2048)


def test_chunks_take_the_longest_prompt_out_of_the_largest_batch() -> None:
    lens = [1000, 100, 1000, 100, 1000]
    whole = sized_prefill_batches(lens, 2048, CPU_LIKE, 2)
    chunked = sized_prefill_batches(lens, 2048, CPU_LIKE, 2, chunk=True)
    assert max(batch_tokens(whole)) >= 1000  # a whole prompt bounds the batch from below
    assert max(batch_tokens(chunked)) <= 256
    phase = {
        name: sum(t := [CPU_LIKE.stage_ms(n, 2) for n in batch_tokens(b)]) + max(t)
        for name, b in (("whole", whole), ("chunked", chunked))
    }
    assert phase["chunked"] < phase["whole"]


@pytest.mark.parametrize("option", ["size_prefill_batches", "chunk_prefills"])
def test_each_option_shortens_a_simulated_job_on_a_cpu_like_table(option: str) -> None:
    inst = InstanceConfig(num_stages=2, capacity_blocks=700, block_size=16, max_batch_tokens=2048)
    workload = WorkloadConfig(num_requests=64, max_input=1023, max_output=96, seed=0)
    runs = {}
    for on in (False, True):
        reqs = generate(workload)  # fresh requests: a run consumes them
        ex = SimExecutor(CPU_LIKE, 2)
        runs[on] = TDPipeScheduler(CPU_LIKE, inst, TDPipeOptions(**{option: on})).run(reqs, ex)
        assert runs[on].output_tokens == sum(r.output_len for r in reqs)
        # every prompt's pieces: in order, and only the last one samples
        sent: dict[str, list[tuple[int, bool]]] = {}
        for phase, items in ex.decisions:
            if phase == "prefill":
                for rid, n, sample in items:
                    sent.setdefault(rid, []).append((n, sample))
        assert all([s for _, s in p] == [False] * (len(p) - 1) + [True] for p in sent.values())
        if option == "chunk_prefills" and on:
            assert any(len(p) > 1 for p in sent.values())
    assert runs[True].makespan_ms < runs[False].makespan_ms
    assert runs[True].bubble_ms < runs[False].bubble_ms


def test_chunking_changes_the_batches_not_when_phases_switch() -> None:
    """The switch rule prices a pending phase as whole prompts either way (td_scheduler
    `_should_prefill`): chunked pricing's cheaper fill and drain made it switch about twice as
    often for no gain."""
    inst = InstanceConfig(num_stages=2, capacity_blocks=700, block_size=16, max_batch_tokens=2048)
    workload = WorkloadConfig(num_requests=64, max_input=1023, max_output=96, seed=0)
    switches = {}
    for chunk in (False, True):
        stats = TDPipeScheduler(CPU_LIKE, inst, TDPipeOptions(chunk_prefills=chunk)).run(generate(workload))
        switches[chunk] = [phase for _, phase in stats.phase_switches]
    assert switches[True] == switches[False] and len(switches[True]) >= 4
