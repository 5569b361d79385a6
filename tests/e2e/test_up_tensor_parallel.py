"""`pdserve up --decode-tensor-parallel-size 2`: the same text as one rank through the OpenAI API,
and SIGKILL of one rank restarts the whole decode node with no rank left behind."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.e2e.router_cluster import free_port
from tests.e2e.test_up import chat, usable_decodes, wait_for
from tests.e2e.up_process import start_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_tp2_decode_node_serves_exactly_and_dies_whole(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_kv_blocks=64)
    want = llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=16, temperature=0))
    expected = want[0].outputs[0].text
    port = free_port()
    up = start_up(["--port", str(port), "--num-decode", "1", "--decode-tensor-parallel-size", "2"])
    proc, lines = up.proc, up.lines
    try:
        assert up.wait_up(300), "\n".join(lines[-40:])
        r = chat(port)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
        node = int(next(re.search(r"decode-0: pid (\d+)", x) for x in lines if "decode-0: pid" in x)[1])
        (rank1,) = _children(node)
        os.kill(rank1, signal.SIGKILL)
        wait_for(lambda: any("decode-0 is back" in x for x in lines), 240, "decode-0 to be restarted")
        wait_for(lambda: not os.path.exists(f"/proc/{node}"), 30, "the old rank 0 to be gone")
        wait_for(lambda: usable_decodes(port) == 1, 60, "the decode node to be usable again")
        r = chat(port)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == expected
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
