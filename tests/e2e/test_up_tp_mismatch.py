"""`pdserve up` with different TP degrees on the prefill and decode sides: P(TP=a) streams each rank's
KV heads into D(TP=b)'s ranks; the greedy text through the OpenAI API is the same as with one rank
each, the prompt really was prefilled remotely, and each decode rank received exactly its share."""

from __future__ import annotations

import json
import math
import os
import re
import signal

import httpx
import pytest

from pdserve.engine import LLM, SamplingParams
from tests.e2e.router_cluster import free_port, metric_value
from tests.e2e.test_up import chat
from tests.e2e.up_process import start_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BLOCK_SIZE = 16


def _free_pair() -> int:
    """A port p with p+1 free too (prefill-0 and decode-0 serve /metrics on consecutive ports)."""
    while True:
        p = free_port()
        if p < 65000 and all(free_port_ok(p + i) for i in range(2)):
            return p


def free_port_ok(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.parametrize("p_tp,d_tp", [(1, 2), (2, 1)])
def test_different_tp_on_prefill_and_decode_gives_the_same_text(p_tp, d_tp, tiny_model_dir):
    llm = LLM(tiny_model_dir, num_kv_blocks=64)  # the text P(TP=1)->D(TP=1) gives (tests/e2e/test_up.py)
    want = llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=16, temperature=0))
    expected = want[0].outputs[0].text
    config = json.loads((tiny_model_dir / "config.json").read_text())
    port, metrics = free_port(), _free_pair()
    args = ["--port", str(port), "--num-decode", "1", "--local-prefill-max-tokens", "0"]
    args += ["--prefill-tensor-parallel-size", str(p_tp), "--decode-tensor-parallel-size", str(d_tp)]
    up = start_up([*args, "--metrics-base-port", str(metrics), "--num-threads", "2"])
    try:
        assert up.wait_up(300), "\n".join(up.lines[-40:])
        r = chat(port)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected
        text = httpx.get(f"http://127.0.0.1:{metrics + 1}/metrics", timeout=10).text
        assert metric_value(text, "pdserve_prefill_decisions_total", location="remote") == 1
        assert metric_value(text, "pdserve_prefill_decisions_total", location="local") == 0
        # each decode rank received exactly its heads' share of the prompt's blocks, layer by layer
        heads, layers = config["num_key_value_heads"], config["num_hidden_layers"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        blocks = math.ceil(r.json()["usage"]["prompt_tokens"] / BLOCK_SIZE)
        per_rank_heads = max(heads // d_tp, 1)
        share = layers * blocks * 2 * per_rank_heads * BLOCK_SIZE * head_dim * 4  # fp32
        for rank in range(d_tp):
            got = metric_value(text, "pdserve_cachestore_rank_received_bytes_total", rank=str(rank))
            assert got == share, (rank, got, share)
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
            up.proc.wait(10)
    assert not [x for x in up.lines if re.search(r"Traceback|refused the write", x)], "\n".join(up.lines[-60:])
