"""Each new architecture served by `pdserve up` (router + prefill + decode processes) gives the text
`pdserve generate` gives on the same checkpoint: Qwen3, Qwen3-MoE, Mixtral and an FP8 Qwen3-MoE,
over tcp and the emulated rdma transport, and a Qwen3-MoE whose decode node is two tensor-parallel
ranks with whole experts each (P TP=1 -> D TP=2). The prompt is prefilled on the prefill node and
its KV streamed into the decode node (local prefill off; one case runs `up`'s defaults); a second
request that shares the first one's prompt reuses its KV; a JSON-schema request is constrained; and
`pdserve batch` runs a MoE model on TD-Pipe stages. DeepSeek-V2/V3 run the same cases, their latent
KV streamed whole into each decode rank; gpt-oss too (sinks, per-layer windows, biases; its decode
ranks split heads and experts), and its chat template answers /v1/chat/completions as `generate
--chat` does. Cases marked slow run in CI's slow pass."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.engine.tiny_model import make_tiny_model
from tests.e2e.cluster import ROOT
from tests.e2e.router_cluster import free_port
from tests.e2e.up_process import start_up

pytestmark = pytest.mark.e2e

PROMPT = "The old lighthouse keeper climbed the stairs every evening to light the lamp, and"
LONGER = PROMPT + " one night he saw a ship"
MAX_TOKENS = 16


def _generate(model_dir, prompt: str, *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--model", str(model_dir), "--prompt", prompt]
        + ["--max-tokens", str(MAX_TOKENS), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r"### prompt: .*?\n(.*)\n\[\d+ tokens, finish_reason=\w+\]\s*$", done.stdout, re.S)
    assert match, done.stdout
    return _whole_chars(match.group(1))


def _whole_chars(text: str) -> str:
    """Text without a trailing replacement character: `generate` prints the bytes of a character that
    the last token began but did not finish as U+FFFD, the router holds them back."""
    return text.rstrip("\ufffd")


def _complete(port: int, prompt: str, **extra) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _chat(port: int, content: str) -> str:
    """The reply to one user message through /v1/chat/completions (the model's chat template)."""
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body | {"temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return _whole_chars(r.json()["choices"][0]["message"]["content"])


CHAT_ARCHS = {"gpt-oss"}
"""Architectures whose case also asks /v1/chat/completions for `generate --chat`'s reply: gpt-oss's
checkpoints ship a harmony-format template, the tiny one the tiny tokenizer's ChatML."""

REMOTE = ["--num-prefill", "1", "--num-decode", "1", "--local-prefill-max-tokens", "0"]
"""One prefill and one decode node, and every prompt prefilled on the prefill node."""


@pytest.mark.parametrize(
    "arch, fp8, transport, shape",
    [
        pytest.param("qwen3", False, "tcp", REMOTE, id="qwen3-tcp", marks=pytest.mark.slow),
        pytest.param("qwen3-moe", False, "rdma", REMOTE, id="qwen3-moe-rdma"),
        pytest.param("mixtral", False, "tcp", REMOTE, id="mixtral-tcp", marks=pytest.mark.slow),
        pytest.param("qwen3-moe", True, "tcp", REMOTE, id="qwen3-moe-fp8-tcp", marks=pytest.mark.slow),
        # P TP=1 -> D TP=2 with whole experts per decode rank: head-sliced KV into the two ranks
        pytest.param(
            "qwen3-moe",
            False,
            "tcp",
            REMOTE + ["--decode-tensor-parallel-size", "2", "--enable-expert-parallel"],
            id="qwen3-moe-p1-d2-ep",
            marks=pytest.mark.slow,
        ),
        # the defaults: 1 prefill, 2 decode, local prefill of short prompts, KV-aware routing
        pytest.param("mixtral", False, "tcp", [], id="mixtral-defaults"),
        # DeepSeek's latent KV (one plane, one "head"): P TP=1 -> D TP=2, every decode rank gets it whole
        pytest.param(
            "deepseek-v3", False, "rdma", REMOTE + ["--decode-tensor-parallel-size", "2"], id="deepseek-v3-p1-d2-rdma"
        ),
        pytest.param("deepseek-v2", False, "tcp", REMOTE, id="deepseek-v2-tcp", marks=pytest.mark.slow),
        pytest.param("deepseek-v2", False, "tcp", [], id="deepseek-v2-defaults", marks=pytest.mark.slow),
        # gpt-oss (sinks, per-layer windows, biases): P TP=1 -> D TP=2, its sinks and o_proj bias split
        pytest.param(
            "gpt-oss", False, "rdma", REMOTE + ["--decode-tensor-parallel-size", "2"], id="gpt-oss-p1-d2-rdma"
        ),
        pytest.param("gpt-oss", False, "tcp", REMOTE, id="gpt-oss-tcp", marks=pytest.mark.slow),
        pytest.param(
            "gpt-oss",
            False,
            "tcp",
            REMOTE + ["--decode-tensor-parallel-size", "2", "--enable-expert-parallel"],
            id="gpt-oss-p1-d2-ep",
            marks=pytest.mark.slow,
        ),
        pytest.param("gpt-oss", False, "tcp", [], id="gpt-oss-defaults", marks=pytest.mark.slow),
    ],
)
def test_up_serves_the_text_generate_gives(tmp_path, arch, fp8, transport, shape):
    model_dir = make_tiny_model(tmp_path / arch, "tiny", arch=arch, fp8=fp8)
    expected = [_generate(model_dir, p) for p in (PROMPT, LONGER)]
    expected_chat = _generate(model_dir, PROMPT, "--chat") if arch in CHAT_ARCHS else None
    port = free_port()
    env_before = os.environ.get("PDSERVE_RDMA_EMULATOR")
    os.environ["PDSERVE_RDMA_EMULATOR"] = "1"  # read by the nodes when --transport rdma
    try:
        up = start_up(
            ["--port", str(port), "--model", str(model_dir), "--served-model-name", "m", "--transport", transport]
            + shape
        )
    finally:
        if env_before is None:
            os.environ.pop("PDSERVE_RDMA_EMULATOR")
        else:
            os.environ["PDSERVE_RDMA_EMULATOR"] = env_before
    try:
        assert up.wait_up(300), "\n".join(up.lines[-40:])
        first = _complete(port, PROMPT)
        assert _whole_chars(first["choices"][0]["text"]) == expected[0]
        # the shared part of the prompt (whole blocks) comes from a decode node's prefix cache: the
        # KV-aware router sends the second request where the first one's KV lives. Its KV events
        # reach the router asynchronously, so on a loaded machine the request may come first: it is
        # sent again (same text every time) until it hits, a few times at most.
        for _ in range(4):
            second = _complete(port, LONGER)
            assert _whole_chars(second["choices"][0]["text"]) == expected[1]
            if second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                break
            time.sleep(1.0)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, second["usage"]
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        constrained = _complete(
            port,
            PROMPT,
            max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        )
        text = constrained["choices"][0]["text"]
        if constrained["choices"][0]["finish_reason"] == "stop":  # complete: it parses and has the key
            assert isinstance(json.loads(text)["n"], int), text
        else:  # cut by max_tokens: still a prefix of the grammar's language
            assert text.lstrip().startswith("{"), text
        if expected_chat is not None:
            assert _chat(port, PROMPT) == expected_chat
    finally:
        if up.proc.poll() is None:
            up.proc.send_signal(signal.SIGINT)
            try:
                up.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.proc.pid, signal.SIGKILL)
                up.proc.wait(10)


@pytest.mark.parametrize(
    "arch",
    ["qwen3-moe", pytest.param("deepseek-v3", marks=pytest.mark.slow), pytest.param("gpt-oss", marks=pytest.mark.slow)],
    ids=["qwen3-moe", "deepseek-v3", "gpt-oss"],
)
def test_batch_on_td_pipe_stages_gives_the_text_generate_gives(tmp_path, arch):
    """`pdserve batch` runs a mixture-of-experts model as a two-stage TD-Pipe pipeline (its layers,
    experts included, moved between the stages by the phase split) and writes generate's text."""
    model_dir = make_tiny_model(tmp_path / "moe", "tiny", arch=arch)
    prompts = [PROMPT, LONGER, "a b c d e f g"]
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions"}
        | {"body": {"model": "moe", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}}
        for i, p in enumerate(prompts)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "batch", "-i", str(tmp_path / "in.jsonl")]
        + ["-o", str(tmp_path / "out.jsonl"), "--model", str(model_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stages=2" in done.stderr + done.stdout
    out = {
        json.loads(line)["custom_id"]: json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()
    }
    for i, prompt in enumerate(prompts):
        text = out[f"r{i}"]["response"]["body"]["choices"][0]["text"]
        assert _whole_chars(text) == _generate(model_dir, prompt)
