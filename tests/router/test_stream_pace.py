"""Stream pace (router/stream_pace.py) and the TPOT guard it gives the prefill offload
(router/prefill_offload.py): a decode node takes a prompt off saturated prefill nodes only while the
pause leaves every stream it serves within --tpot-slo."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.router.balancer import NodeLoad
from pdserve.router.prefill_offload import Offload, OffloadPolicy
from pdserve.router.stream_pace import Stream, Streams
from pdserve.v1 import common_pb2, decode_pb2
from tests.router.kv_fake_node import FakeKvNode, until
from tests.router.test_prefill_offload import NO_BOUND, GatedNode, _drain, decode_and_prefill

PROMPT = 800


def tokens_at(streams: Streams, stream: Stream, times: list[float]) -> None:
    for t in times:
        streams.arrived(stream, 1, now=t)


def test_a_streams_tpot_is_its_time_so_far_the_pause_and_its_rest_at_the_nodes_step():
    streams = Streams()
    s = streams.open(max_tokens=49)
    tokens_at(streams, s, [10.0 + 0.05 * i for i in range(9)])  # 9 tokens 0.05 s apart, by 10.4
    assert streams.step == pytest.approx(0.05)
    # 0.4 s so far, 40 tokens to go at 0.05: 2.4 s over 48 gaps
    assert s.tpot_after(0.0, streams.step, now=10.4) == pytest.approx(0.05)
    assert s.tpot_after(4.8, streams.step, now=10.4) == pytest.approx(0.05 + 4.8 / 48)
    # the time since its last token counts: a stream already waiting is slower
    assert s.tpot_after(0.0, streams.step, now=10.8) > 0.05


def test_a_pause_is_counted_once_not_for_every_token_left():
    """A stream whose second token came after a 1.5 s pause ends near (1.5 + 47 steps) / 47 s a
    token, not 1.5 s a token: the node's step is the median gap, which one pause does not move."""
    streams = Streams()
    steady = streams.open(max_tokens=49)
    tokens_at(streams, steady, [0.03 * i for i in range(20)])
    young = streams.open(max_tokens=48)
    tokens_at(streams, young, [0.57, 2.07])  # its first token, then a 1.5 s pause
    assert streams.step == pytest.approx(0.03)
    assert young.tpot_after(0.0, streams.step, now=2.07) == pytest.approx((1.5 + 46 * 0.03) / 47)
    assert streams.worst_tpot_after(0.0, now=2.07) < 0.1


def test_before_its_first_token_a_pause_is_ttft_not_tpot():
    streams = Streams()
    waiting = streams.open(max_tokens=11)
    assert waiting.tpot_after(100.0, 0.03, now=5.0) == pytest.approx(0.03)
    streams.arrived(waiting, 0, now=5.0)  # an event with no token changes nothing
    assert waiting.first_token_at is None and streams.step == 0.0


def test_an_event_of_several_tokens_spreads_its_gap_over_them():
    streams = Streams()
    s = streams.open(max_tokens=100)
    streams.arrived(s, 1, now=0.0)
    streams.arrived(s, 4, now=0.2)
    assert streams.step == pytest.approx(0.05) and s.tokens == 5


def test_one_token_streams_do_not_divide_by_zero():
    streams = Streams()
    s = streams.open(max_tokens=1)
    streams.arrived(s, 1, now=0.0)
    assert s.tpot_after(2.0, 0.0, now=0.0) == pytest.approx(2.0)


def test_the_worst_stream_decides_and_closed_ones_leave():
    streams = Streams()
    assert streams.worst_tpot_after(100.0, now=0.0) == 0.0  # serving none: no stream to hurt
    long_, short = streams.open(481), streams.open(11)
    streams.arrived(long_, 1, now=0.0)
    streams.arrived(short, 1, now=0.0)
    assert len(streams) == 2
    assert streams.worst_tpot_after(1.0, now=0.0) == pytest.approx(0.1)  # the short one: 1 s over 10 gaps
    streams.close(short)
    streams.close(short)  # twice: nothing
    assert streams.worst_tpot_after(1.0, now=0.0) == pytest.approx(1 / 480)
    streams.close(long_)
    assert len(streams) == 0


def saturated(rate: float | None = None) -> NodeLoad:
    """A prefill node with one 800-token prompt pending (saturated at 256), rate tokens/s measured."""
    node = NodeLoad("p", prefilling_tokens=PROMPT)
    if rate is not None:
        node.prefill_rate.started(0.0)
        node.prefill_rate.finished(int(rate), 1.0, idle=False, computed=True)
    return node


def decoding(max_tokens: int, pace: float, tokens: int = 11) -> NodeLoad:
    """A decode node serving one stream that has had `tokens` tokens `pace` s apart by now=100."""
    node = NodeLoad("d")
    stream = node.streams.open(max_tokens)
    tokens_at(node.streams, stream, [100.0 - pace * (tokens - 1 - i) for i in range(tokens)])
    return node


def test_without_a_tpot_slo_the_pause_is_not_weighed():
    assert (
        OffloadPolicy(256).decide([saturated(rate=500.0)], decoding(49, pace=0.2), PROMPT, now=100.0) is Offload.LOCAL
    )


def test_a_pause_that_would_break_tpot_sends_the_prompt_to_the_prefill_node():
    policy = OffloadPolicy(256, tpot_slo=0.25)
    # 800 tokens at 500 tokens/s: a 1.6 s pause; 0.2 + 1.6 / 48 = 0.233 <= 0.25 takes it
    assert policy.decide([saturated(rate=500.0)], decoding(49, pace=0.2), PROMPT, now=100.0) is Offload.LOCAL
    # at 0.23 s a token already the same pause makes 0.263 > 0.25: the prompt waits for the prefill node
    assert policy.decide([saturated(rate=500.0)], decoding(49, pace=0.23), PROMPT, now=100.0) is Offload.HELD
    # a long stream spreads the pause over more tokens
    assert policy.decide([saturated(rate=500.0)], decoding(481, pace=0.23), PROMPT, now=100.0) is Offload.LOCAL


def test_the_decode_nodes_own_rate_and_pending_prompts_set_the_pause():
    policy = OffloadPolicy(256, tpot_slo=0.25)
    node = decoding(49, pace=0.05)
    node.prefill_rate.started(0.0)
    node.prefill_rate.finished(100, 1.0, idle=False, computed=True)  # a slow node: 100 tokens/s
    # its own rate: 800 / 100 = 8 s, 0.05 + 8 / 48 = 0.217: taken
    assert policy.decide([saturated(rate=10_000.0)], node, PROMPT, now=100.0) is Offload.LOCAL
    node.prefilling_tokens = 400  # and with 400 of its own pending: 12 s, 0.3 > 0.25
    policy_queue = saturated(rate=10_000.0)
    policy_queue.prefilling_tokens = 1600  # (the prefill queue longer still, so only TPOT refuses)
    assert policy.decide([policy_queue], node, PROMPT, now=100.0) is Offload.HELD


def test_with_no_rate_measured_anywhere_it_offloads_to_measure_one():
    policy = OffloadPolicy(256, tpot_slo=0.25)
    assert policy.decide([saturated()], decoding(49, pace=0.3), PROMPT, now=100.0) is Offload.LOCAL


def test_a_tpot_slo_must_be_positive():
    with pytest.raises(ValueError, match="--tpot-slo"):
        OffloadPolicy(256, tpot_slo=0.0)


async def test_generate_tracks_each_attempts_stream_on_its_decode_node():
    """The router counts a stream on its decode node from the attempt's start to its end, with the
    tokens that came back: what the offload's TPOT guard reads."""
    decode = GatedNode()
    async with decode_and_prefill(decode, refresh_interval=0.05) as (cluster, _):
        node = next(n.load for n in cluster.nodes.values() if n.member.role == "decode")
        params = common_pb2.SamplingParams(max_tokens=7)
        request = decode_pb2.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3], params=params)
        task = asyncio.ensure_future(_drain(cluster.generate(request)))
        await until(lambda: len(node.streams) == 1)
        (stream,) = node.streams._by_id.values()
        assert stream.max_tokens == 7 and stream.tokens == 0
        decode.gate.set()
        tokens = await task
        assert tokens and stream.tokens == len(tokens) and stream.first_token_at is not None
        assert len(node.streams) == 0
        # an attempt abandoned before its first token leaves no stream behind
        decode.gate.clear()
        request.request_id = "r2"
        task = asyncio.ensure_future(_drain(cluster.generate(request)))
        await until(lambda: len(node.streams) == 1)
        task.cancel()
        await until(lambda: len(node.streams) == 0)


async def test_the_router_holds_a_prompt_off_a_decode_node_whose_streams_it_would_break():
    """Every prefill node saturated: without streams on it the decode node takes the prompt; with a
    stream the pause would push past --tpot-slo it goes to the prefill node, and the router counts it."""
    policy = OffloadPolicy(256, tpot_slo=0.25)
    nodes = decode_and_prefill(FakeKvNode(num_blocks=512), refresh_interval=60, offload=policy, deadlines=NO_BOUND)
    async with nodes as (cluster, prefill):
        loads = {n.member.role: n.load for n in cluster.nodes.values()}
        loads["prefill"].prefill_rate.started(0.0)
        loads["prefill"].prefill_rate.finished(500, 1.0, idle=False, computed=True)  # 800 tokens: a 1.6 s pause
        loads["prefill"].prefilling_tokens = 1600  # two long prompts pending: saturated
        prompt = list(range(1, PROMPT + 1))
        streams = loads["decode"].streams
        stream = streams.open(max_tokens=11)  # 1.6 s over 10 gaps: 0.16 s a token, within
        streams.arrived(stream, 1, time.monotonic())
        assert cluster._choose(PROMPT + 64, set(), prompt, None).prefills == []
        short = streams.open(max_tokens=5)  # 1.6 s over 4 gaps: 0.4 s a token, past it
        streams.arrived(short, 1, time.monotonic())
        route = cluster._choose(PROMPT + 64, set(), prompt, None)
        assert route.prefills == [prefill]
        assert cluster.offload_held._value.get() == 1
        streams.close(short)
        streams.close(stream)
