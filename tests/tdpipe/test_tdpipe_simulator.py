"""Simulator: cost tables, pipeline timing and every policy on a small workload."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.tdpipe.config import InstanceConfig, TDPipeOptions
from pdserve.tdpipe.cost_table import DATA_DIR, PUBLISHED_SOURCE, TABLES_ENV, CostTable
from pdserve.tdpipe.pipeline import Pipeline, SimStats
from pdserve.tdpipe.simulator import POLICIES, plot_kv_usage, simulate
from pdserve.tdpipe.workload import WorkloadConfig, generate


PUBLISHED = ("L20-Llama-13B", "L20-Qwen2.5-32B", "L20-opt-125m")


def _published(name: str) -> CostTable:
    """Load a published L20 table; skip only when no folder that could hold it exists.

    The tables are third-party data, not committed (see tdpipe/data/README.md). When
    $PDSERVE_TDPIPE_TABLES is set, or the shared `tdpipe/` folder beside the checkout
    exists (it does on CI), the tables are meant to be there: a missing or unreadable
    file must fail this test, not skip it, or the simulator report silently loses them.
    """
    shared = DATA_DIR.parents[3] / "shared" / "tdpipe"
    downloaded = (DATA_DIR / f"{name}.csv").is_file()
    if not os.environ.get(TABLES_ENV) and not shared.is_dir() and not downloaded:
        pytest.skip(
            f"no published L20 table folder: put {name}.csv (from {PUBLISHED_SOURCE}) in {shared}, "
            f"in tdpipe/data/, or in a folder named by ${TABLES_ENV}"
        )
    return CostTable.builtin(name)  # a load error here fails loudly


def test_published_l20_table_loads() -> None:
    table = _published("L20-Llama-13B")
    assert table.tokens[0] == 1 and table.tokens[-1] == 2048
    assert 30 < table.forward_ms(1) < 40 and table.forward_ms(2048) > 400
    assert table.forward_ms(4096) > table.forward_ms(2048)  # linear extrapolation


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_published_table_loads(name: str) -> None:
    table = _published(name)
    assert table.name == name and table.tokens[0] == 1 and table.tokens[-1] == 2048
    assert table.forward_ms(2048) > table.forward_ms(1) > 0


def test_published_table_folder_present_means_no_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table folder that exists but lacks (or garbles) the file is an error, not a skip."""
    monkeypatch.setenv(TABLES_ENV, str(tmp_path))
    (tmp_path / "L20-Llama-13B.csv").write_text("Total Length,Execute Time\n1,not-a-number\n")
    with pytest.raises(ValueError):
        _published("L20-Llama-13B")


def test_unknown_table_and_analytic_table() -> None:
    with pytest.raises(ValueError, match="unknown cost table"):
        CostTable.builtin("nope")
    with pytest.raises(ValueError, match="not shipped"):
        CostTable.builtin("L20-Nonexistent")
    t = CostTable.analytic()
    assert t.forward_ms(1) == pytest.approx(33.2) and t.forward_ms(2048) == pytest.approx(33 + 409.6)


def test_pipeline_flow_shop_timing() -> None:
    stats = SimStats("t")
    pipe = Pipeline(CostTable("flat", (1,), (40.0,)), 4, stats)  # 10 ms per stage
    assert pipe.submit(1, 0.0) == pytest.approx(40.0)
    assert pipe.submit(1, 0.0) == pytest.approx(50.0)  # pipelined one stage behind
    assert pipe.submit(1, 100.0) == pytest.approx(140.0)  # a dependent batch waits
    assert stats.bubble_ms == pytest.approx(4 * 140.0 - 3 * 40.0)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_completes_all_tokens(policy: str) -> None:
    reqs = generate(WorkloadConfig(num_requests=120, seed=5))
    inst = InstanceConfig(capacity_blocks=1500)
    stats = simulate(policy, CostTable.analytic(), inst, reqs)
    assert stats.output_tokens == sum(r.output_len for r in reqs)  # also asserted inside
    assert stats.throughput > 0 and 0 <= stats.bubble_ms
    assert all(0 <= u <= 1.0 for _, u in stats.kv_samples)
    assert reqs[0].num_generated == 0  # the caller's requests are untouched


def test_td_pipe_beats_pp_separate_batching_and_plots(tmp_path: Path) -> None:
    reqs = generate(WorkloadConfig(num_requests=400, seed=6))
    table, inst = CostTable.analytic(), InstanceConfig(capacity_blocks=4000)
    td = simulate("td-pipe", table, inst, reqs)
    sb = simulate("pp+sb", table, inst, reqs)
    assert td.throughput > sb.throughput
    assert [p for _, p in td.phase_switches[:2]] == ["prefill", "decode"]
    plot_kv_usage([td, sb], tmp_path / "kv.png")
    assert (tmp_path / "kv.png").stat().st_size > 1000


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_stages"):
        InstanceConfig(num_stages=0)
    with pytest.raises(ValueError, match="prefill_switch"):
        TDPipeOptions(prefill_switch="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown policy"):
        simulate("vllm", CostTable.analytic(), InstanceConfig(), [])
    with pytest.raises(ValueError, match="num_requests"):
        WorkloadConfig(num_requests=0)
