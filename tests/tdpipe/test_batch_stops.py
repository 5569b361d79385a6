"""Stop strings end generation at the pipeline's last stage: `usage` and text of a batch line equal
what the engine (engine.LLM) and the HTTP API (`pdserve up`) give for the same request.

The tiny model's greedy text is gibberish, so each stop string is cut from the engine's own
continuation of the prompt: it is sure to occur, part-way through, and the request must end there.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from pdserve.engine import LLM, SamplingParams
from tests.e2e.router_cluster import free_port
from tests.e2e.up_process import start_up
from tests.tdpipe.batch_helpers import PROMPTS, batch_cmd, read_results, stop_string_in

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stop_bodies(tiny_model_dir) -> dict[str, tuple[str, dict]]:
    """custom_id -> (url, body): completions and a chat line, each with a stop string that occurs."""
    free = LLM(tiny_model_dir).generate(
        PROMPTS[:4], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    bodies: dict[str, tuple[str, dict]] = {}
    for i, (prompt, out) in enumerate(zip(PROMPTS[:4], free)):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        body["stop"] = [stop_string_in(out.outputs[0].text), "never-in-the-text"]
        if i == 1:
            body["include_stop_str_in_output"] = True
        bodies[f"s{i}"] = ("/v1/completions", body)
    messages = [{"role": "user", "content": "hi"}]
    chat_text = (
        LLM(tiny_model_dir)
        .chat(messages, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    chat = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    bodies["chat"] = ("/v1/chat/completions", {**chat, "stop": stop_string_in(chat_text)})
    return bodies


def _run_batch(tmp_path, bodies: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    lines = [
        json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": b}) for cid, (url, b) in bodies.items()
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run(batch_cmd(tmp_path, "--cost-table", "analytic"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = read_results(tmp_path / "out.jsonl")
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in rows), rows
    return {r["custom_id"]: r["response"]["body"] for r in rows}


def _answer(body: dict) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of a non-streaming completion or chat completion body."""
    choice = body["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return text, choice["finish_reason"], {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")}


def test_stop_strings_end_generation_with_the_engines_usage(tmp_path, tiny_model_dir, stop_bodies) -> None:
    got = _run_batch(tmp_path, stop_bodies)
    llm = LLM(tiny_model_dir)
    for cid, (url, body) in stop_bodies.items():
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            stop=body["stop"],
            include_stop_str_in_output=body.get("include_stop_str_in_output", False),
        )
        out = (llm.chat(body["messages"], params) if "messages" in body else llm.generate(body["prompt"], params))[0]
        text, reason, use = _answer(got[cid])
        assert reason == "stop" and out.outputs[0].finish_reason == "stop", cid
        # the engine stops on the token that completes the stop string: the pipeline spends no more
        assert use["completion_tokens"] == len(out.outputs[0].token_ids) < MAX_TOKENS, cid
        assert use["prompt_tokens"] == len(out.prompt_token_ids), cid
        assert text == out.outputs[0].text, cid
    assert got["s1"]["choices"][0]["text"].endswith(stop_bodies["s1"][1]["stop"][0])  # include_stop_str_in_output


@pytest.mark.slow
def test_stop_strings_usage_equals_the_http_api(tmp_path, stop_bodies) -> None:
    got = _run_batch(tmp_path, stop_bodies)
    port = free_port()
    up = start_up(["--port", str(port), "--num-prefill", "1", "--num-decode", "1", "--local-prefill-max-tokens", "0"])
    try:
        assert up.wait_up(), "\n".join(up.lines[-40:])
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        for cid, (url, body) in stop_bodies.items():
            r = httpx.post(base + url, json={**body, "model": model}, timeout=120)
            assert r.status_code == 200, r.text
            assert _answer(got[cid]) == _answer(r.json()), cid
    finally:
        if up.proc.poll() is None:
            up.proc.terminate()
            try:
                up.proc.wait(60)
            except subprocess.TimeoutExpired:
                up.proc.kill()
                up.proc.wait(10)
