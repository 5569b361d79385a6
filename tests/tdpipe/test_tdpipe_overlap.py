"""TD-Pipe's non-draining phase switches (tdpipe/td_overlap.py): prefills enter the pipeline
while decode batches are still in it, the real KV blocks are never over-committed, and every
token is produced."""

from __future__ import annotations

import copy

from pdserve.engine.block_manager import blocks_for
from pdserve.tdpipe.config import InstanceConfig
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.executor import Batch, SimExecutor
from pdserve.tdpipe.overheads import LinearCost, PipelineOverheads
from pdserve.tdpipe.simulator import make_policy
from pdserve.tdpipe.td_overlap import decode_batches_in_flight
from pdserve.tdpipe.workload import SimRequest, WorkloadConfig, generate

INST = InstanceConfig(num_stages=2, capacity_blocks=600, block_size=16, max_batch_tokens=1024)


class CheckingExecutor(SimExecutor):
    """The simulator, plus the runtime's block allocation (StageExecutor's rule): a batch takes the
    blocks its new tokens need when it is submitted, and there must be that many free."""

    def __init__(self, table: CostTable, inst: InstanceConfig) -> None:
        super().__init__(table, inst.num_stages)
        self.free_blocks, self.block_size = inst.capacity_blocks, inst.block_size
        self.blocks: dict = {}
        self.computed: dict = {}
        self.prefill_behind_decode = 0
        """Prefill batches submitted while a decode batch was in flight (an overlapped switch)."""

    def _start(self, batch: Batch) -> None:
        if batch.phase == "prefill" and any(b.phase == "decode" for b in self.inflight):
            self.prefill_behind_decode += 1
        for item in batch.items:
            rid = item.request.request_id
            end = self.computed.get(rid, 0) + item.num_tokens
            need = blocks_for(end, self.block_size) - self.blocks.get(rid, 0)
            assert need <= self.free_blocks, f"over-committed: {rid} needs {need}, {self.free_blocks} free"
            self.free_blocks -= need
            self.blocks[rid] = self.blocks.get(rid, 0) + need
        super()._start(batch)

    def _complete(self, batch: Batch) -> None:
        for item in batch.items:
            rid = item.request.request_id
            self.computed[rid] = self.computed.get(rid, 0) + item.num_tokens

    def free(self, request: SimRequest) -> None:
        self.free_blocks += self.blocks.pop(request.request_id, 0)
        self.computed.pop(request.request_id, None)


def _run(policy: str, table: CostTable, requests: list[SimRequest]) -> tuple[CheckingExecutor, object]:
    executor = CheckingExecutor(table, INST)
    stats = make_policy(policy, table, INST).run(copy.deepcopy(requests), executor)
    assert stats.output_tokens == sum(r.output_len for r in requests)
    assert executor.free_blocks == INST.capacity_blocks  # every block came back
    return executor, stats


def _workload() -> list[SimRequest]:
    return generate(WorkloadConfig(num_requests=120, max_input=400, max_output=200, seed=3))


def test_switches_overlap_and_never_over_commit_the_kv() -> None:
    overlap, stats = _run("td-pipe-overlap", CostTable.analytic(), _workload())
    assert len(stats.phase_switches) > 2  # the KV binds: several prefill phases
    assert overlap.prefill_behind_decode > 0
    drained, _ = _run("td-pipe", CostTable.analytic(), _workload())
    assert drained.prefill_behind_decode == 0  # the default policy empties the pipeline first


def test_overlap_and_more_batches_hide_a_costly_round_trip() -> None:
    # a CPU-like table (the per-token cost dominates) with an 8 ms dispatch round trip per batch:
    # draining at every switch and 2 batches on 2 stages leave the stages idle for it
    over = PipelineOverheads(LinearCost(1.0, 0.001), LinearCost(8.0, 0.0))
    table = CostTable("cpu-like", (1, 64, 1024), (4.0, 60.0, 600.0), over)
    _, overlapped = _run("td-pipe-overlap", table, _workload())
    _, drained = _run("td-pipe", table, _workload())
    bubble = lambda s: s.bubble_ms / (s.num_stages * s.makespan_ms)  # noqa: E731
    assert overlapped.throughput > 1.03 * drained.throughput
    assert bubble(overlapped) < bubble(drained) - 0.05


def test_decode_batches_in_flight_follows_the_overheads() -> None:
    cpu = (1, 64, 1024), (4.0, 60.0, 600.0)
    assert decode_batches_in_flight(CostTable("ideal", *cpu), 2, 100) == 2  # nothing to hide
    slow = CostTable("slow", *cpu, PipelineOverheads(dispatch=LinearCost(8.0, 0.0)))
    assert 2 < decode_batches_in_flight(slow, 2, 100) <= 4
    # a step of mostly fixed cost (a GPU): smaller batches cost too much, keep one per stage
    gpu = CostTable("gpu", (1, 1024), (40.0, 60.0), PipelineOverheads(dispatch=LinearCost(2.0, 0.0)))
    assert decode_batches_in_flight(gpu, 2, 100) == 2
