"""The cluster simulation (planner/cluster.py, planner/instances.py): one request's latencies are the
profile's times, batching and queueing behave as the schedulers they model."""

from __future__ import annotations

import pytest
from planner_helpers import config, linear_table, requests

from pdserve.planner.cluster import Shape, simulate
from pdserve.planner.workload import Lengths, from_lengths

TABLE = linear_table()
DISAGG, COLOC = Shape(1, 1, 1, 1), Shape(0, 0, 1, 1)


def test_one_request_ttft_is_its_prefill_plus_the_transfer_and_tpot_one_decode_step() -> None:
    (out,) = simulate(DISAGG, TABLE, TABLE, [Lengths(500, 11)], [3.0], config(transfer_ms_per_token=0.02))
    assert out.ttft == pytest.approx((TABLE.forward_ms(500) + 0.02 * 500) / 1000)
    assert out.tpot == pytest.approx(TABLE.forward_ms(1) / 1000)


def test_a_colocated_request_prefills_in_chunks_of_the_budget_then_decodes() -> None:
    (out,) = simulate(COLOC, None, TABLE, [Lengths(300, 5)], [0.0], config(max_batch_tokens=128))
    chunks = 2 * TABLE.forward_ms(128) + TABLE.forward_ms(44)  # 128 + 128 + 44 prompt tokens
    assert out.ttft == pytest.approx(chunks / 1000)
    assert out.tpot == pytest.approx(TABLE.forward_ms(1) / 1000)


def test_a_one_token_output_ends_at_its_first_token() -> None:
    (out,) = simulate(DISAGG, TABLE, TABLE, [Lengths(100, 1)], [0.0], config())
    assert out.ttft == pytest.approx(TABLE.forward_ms(100) / 1000) and out.tpot == 0.0


def test_prompts_queued_behind_a_batch_share_the_next_one_up_to_the_budget() -> None:
    outs = simulate(DISAGG, TABLE, TABLE, requests(4, 100, 2), [0.0] * 4, config(max_batch_tokens=200))
    one, two = TABLE.forward_ms(100) / 1000, TABLE.forward_ms(200) / 1000
    # FCFS: the first starts alone at once (nothing waits for a batch to fill), the next two share a
    # batch of the budget, the last runs after them
    assert sorted(o.ttft for o in outs) == pytest.approx([one, one + two, one + two, 2 * one + two])


def test_decode_steps_are_priced_at_the_batch_and_a_late_request_joins_at_the_next_step() -> None:
    a, b = Lengths(100, 11), Lengths(100, 3)
    outs = simulate(DISAGG, TABLE, TABLE, [a, b], [0.0, 0.04], config())
    f = lambda n: TABLE.forward_ms(n) / 1000  # noqa: E731
    a_first = f(100)
    b_first = 0.04 + f(100)  # the prefill instance was idle again when b came
    assert a_first + f(1) < b_first < a_first + 2 * f(1)  # b lands during a's second step...
    joined = a_first + 2 * f(1)  # ...and joins after it
    b_done = joined + 2 * f(2)
    a_done = b_done + 6 * f(1)
    by_ttft = sorted(outs)
    assert by_ttft[0].ttft == pytest.approx(a_first) and by_ttft[0].tpot == pytest.approx((a_done - a_first) / 10)
    assert by_ttft[1].ttft == pytest.approx(b_first - 0.04) and by_ttft[1].tpot == pytest.approx((b_done - b_first) / 2)


def test_the_kv_limit_makes_a_request_wait_for_room() -> None:
    roomy = simulate(DISAGG, TABLE, TABLE, requests(2, 100, 10), [0.0, 0.0], config(kv_tokens=1000))
    tight = simulate(DISAGG, TABLE, TABLE, requests(2, 100, 10), [0.0, 0.0], config(kv_tokens=110))
    assert max(o.tpot for o in tight) > 1.5 * max(o.tpot for o in roomy)  # one waits out the other's decode


@pytest.mark.parametrize("shape", [DISAGG, COLOC, Shape(2, 1, 1, 1)])
def test_queueing_grows_with_the_rate(shape: Shape) -> None:
    work = from_lengths(400, 20, 0.5, 60, seed=1)
    mean_ttft = []
    for rate in (0.5, 4.0, 16.0, 64.0, 256.0):
        outs = simulate(shape, TABLE, TABLE, list(work.requests), work.arrivals(rate), config())
        assert len(outs) == 60
        mean_ttft.append(sum(o.ttft for o in outs) / len(outs))
    assert mean_ttft == sorted(mean_ttft) and mean_ttft[-1] > 5 * mean_ttft[0]


def test_shape_units_and_labels() -> None:
    assert Shape(2, 2, 1, 4).units == 8 and Shape(2, 2, 1, 4).label("gpu") == "2P(tp2):1D(tp4)"
    assert Shape(0, 0, 3, 1).label("core") == "0P:3D(1t) colocated" and Shape(0, 0, 3, 1).units == 3


def test_a_short_prompt_prefills_on_the_decode_instance_with_no_transfer() -> None:
    cfg = config(local_prefill_max_tokens=64, transfer_ms_per_token=0.5)
    (short,) = simulate(DISAGG, TABLE, TABLE, [Lengths(64, 3)], [0.0], cfg)
    (long,) = simulate(DISAGG, TABLE, TABLE, [Lengths(65, 3)], [0.0], cfg)
    assert short.ttft == pytest.approx(TABLE.forward_ms(64) / 1000)  # one chunk, on the decode instance
    assert long.ttft == pytest.approx((TABLE.forward_ms(65) + 0.5 * 65) / 1000)  # prefill instance, then the wire


def test_a_saturated_prefill_instance_has_a_decode_instance_prefill_the_next_prompt() -> None:
    """The router's offload rule: queue 200 >= 150 and the decode instance's 0 + 100 <= 200."""
    arrivals = [0.0, 0.0, 0.0]
    queued = simulate(DISAGG, TABLE, TABLE, requests(3, 100, 2), arrivals, config(max_batch_tokens=100))
    offloaded = simulate(
        DISAGG, TABLE, TABLE, requests(3, 100, 2), arrivals, config(max_batch_tokens=100, prefill_saturated_tokens=150)
    )
    one = TABLE.forward_ms(100) / 1000
    assert sorted(o.ttft for o in queued) == pytest.approx([one, 2 * one, 3 * one])  # one batch after another
    assert sorted(o.ttft for o in offloaded) == pytest.approx([one, one, 2 * one])  # the third ran beside the first


def test_the_offload_rule_counts_the_decode_instances_own_prompts() -> None:
    """Five prompts at once, queue limit 150: 1st and 2nd to the prefill instance (queue 0, 100); 3rd
    and 4th to the decode instance (queue 200 >= its 0 + 100, then 100 + 100); the 5th back to the
    prefill instance (200 + 100 > 200)."""
    cfg = config(max_batch_tokens=100, prefill_saturated_tokens=150)
    outs = simulate(DISAGG, TABLE, TABLE, requests(5, 100, 2), [0.0] * 5, cfg)
    f = lambda n: TABLE.forward_ms(n) / 1000  # noqa: E731
    prefilled = [f(100), 2 * f(100), 3 * f(100)]  # one batch of 100 tokens after another
    local = [f(100), 2 * f(100) + f(1)]  # the 4th: 99 tokens beside the 3rd's decode step, then 1
    assert sorted(o.ttft for o in outs) == pytest.approx(sorted(prefilled + local), rel=0.01)
