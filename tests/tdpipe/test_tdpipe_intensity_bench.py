"""benchmarks/tdpipe_intensity.py: its probes see every decision and change nothing."""

from __future__ import annotations

from benchmarks.tdpipe_intensity import run_one, variants
from pdserve.tdpipe.config import InstanceConfig, TDPipeOptions
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.simulator import simulate
from pdserve.tdpipe.workload import WorkloadConfig, generate


def test_probed_run_matches_the_plain_simulator_and_records_switches() -> None:
    reqs = generate(WorkloadConfig(num_requests=200, seed=3))
    table, inst = CostTable.analytic(), InstanceConfig(capacity_blocks=3000)
    row = run_one(table, inst, reqs, "after", TDPipeOptions(), {})
    plain = simulate("td-pipe", table, inst, reqs)
    assert row["tok_s"] == round(plain.throughput, 1)  # probing does not change the run
    assert row["cycles"] >= 2 and row["sw_done"] is not None and 0 < row["sw_done"] < 1
    assert 0 < row["sw_spatial"] <= 1 and row["decode_batch"] > 1
    assert set(variants(quick=True)) == {"before", "after", "completion-0.3", "completion-0.5"}
