"""benchmarks/agentic.py's workload: private contexts, revisited round robin, each visit the whole history."""

from __future__ import annotations

from benchmarks.agentic import workload


def test_sessions_share_nothing_and_each_visit_extends_its_history():
    requests = workload(sessions=3, context=40, visits=2, step=5)
    assert [s for s, _ in requests] == [0, 1, 2, 0, 1, 2]  # round robin
    first, second = requests[0][1], requests[3][1]
    assert len(first) == 45 and second[:45] == first and len(second) == 50  # the history grows by each step
    heads = {tuple(p[:8]) for _, p in requests[:3]}
    assert len(heads) == 3  # no prefix shared between sessions (random tokens: a collision is impossible here)
    assert requests == workload(sessions=3, context=40, visits=2, step=5)  # seeded: the same run every time


def test_revisit_figures_count_revisits_only_against_what_each_session_already_had():
    from benchmarks.agentic import revisit_figures

    # (session, prompt tokens, TTFT s, cached tokens, generated, seconds); max_tokens 4, blocks of 8
    visits = [(0, 40, 5.0, 0, 4, 6.0), (1, 40, 5.0, 0, 4, 6.0), (0, 50, 1.0, 40, 4, 1.5), (1, 50, 3.0, 0, 4, 0.5)]
    got = revisit_figures(visits, block_size=8, max_tokens=4, wall=8.0)
    # each revisit could reuse its session's 40 + 4 - 1 = 43 tokens, 40 of them in whole blocks
    assert got["cached_fraction"] == 0.5  # 40 of a bound of 80
    assert got["revisit_ttft_p50_s"] == 3.0  # of the revisits 1.0 and 3.0 (nearest rank); first visits left out
    assert got["throughput_tok_s"] == 4.0  # the revisits: 8 tokens in 1.5 + 0.5 s
    assert got["run_throughput_tok_s"] == 2.0  # every visit: 16 tokens over the 8.0 s wall


def test_a_refused_vllm_start_is_named_by_its_root_cause_not_its_wrapper():
    from benchmarks.agentic import root_cause

    log = (
        "INFO 11-30 starting\n"
        "(EngineCore pid=1) ERROR 11-30 [core.py:1] AssertionError: gpu_tensor.is_cuda or gpu_tensor.is_xpu\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n"
    )
    assert root_cause(log) == "AssertionError: gpu_tensor.is_cuda or gpu_tensor.is_xpu"
    assert "initialization failed" in root_cause("RuntimeError: Engine core initialization failed.\n")
