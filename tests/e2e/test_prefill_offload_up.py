"""`pdserve up --prefill-saturated-tokens`: while the prefill node is busy the router sends prompts
to the decode nodes to prefill themselves; greedy outputs are the offline engine's either way."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.engine import LLM, SamplingParams
from tests.e2e.router_cluster import free_port
from tests.e2e.up_process import start_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(40)] for i in range(8)]


def decisions(metrics_port: int, location: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    found = re.search(rf'pdserve_prefill_decisions_total{{location="{location}"[^}}]*}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_offloaded_prompts_prefill_on_decode_nodes_with_identical_greedy_output(tiny_model_dir):
    port, metrics = free_port(), free_port()
    args = ["--port", str(port), "--model", str(tiny_model_dir), "--num-prefill", "1", "--num-decode", "2"]
    # 1 token: saturated as soon as one prompt is in flight; short prompts must not be local by length
    args += ["--prefill-saturated-tokens", "1", "--local-prefill-max-tokens", "0"]
    up = start_up([*args, "--metrics-base-port", str(metrics), "--served-model-name", "tiny"])
    try:
        assert up.wait_up(), "\n".join(up.lines[-40:])

        def complete(prompt: list[int]) -> list[int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            body["return_token_ids"] = True
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: the prefill node is busy
            got = list(pool.map(complete, PROMPTS))
        local = sum(decisions(metrics + k, "local") for k in (1, 2))  # decode-0, decode-1
        remote = sum(decisions(metrics + k, "remote") for k in (1, 2))
        assert local >= 1 and remote >= 1 and local + remote == len(PROMPTS), (local, remote)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in LLM(tiny_model_dir, num_kv_blocks=256).generate(PROMPTS, params)]
        assert got == expected
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
            up.proc.wait(10)
