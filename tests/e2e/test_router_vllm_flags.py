"""`pdserve router` as a process with vLLM's flags: several served names, --max-model-len as a ceiling,
an inline --chat-template, --tokenizer and --generation-config DIR, before any node is up."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.e2e.cluster import start, stop
from tests.e2e.router_cluster import free_port

pytestmark = pytest.mark.e2e


def test_router_process_serves_vllm_flags_without_nodes(tiny_model_dir, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5}))
    port = free_port()
    router = start(
        "router",
        [
            "--port",
            str(port),
            "--model",
            str(tiny_model_dir),
            "--tokenizer",
            str(tiny_model_dir),
            "--decode",
            f"127.0.0.1:{free_port()}",
            "--served-model-name",
            "a",
            "b",
            "--max-model-len",
            "50",
            "--chat-template",
            "T:{{ messages[0].content }}",
            "--generation-config",
            str(tmp_path),
            "--capacity-wait",
            "0",
            "--disable-log-requests",
        ],  # fmt: skip
    )
    base = f"http://127.0.0.1:{port}"
    try:
        models = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["a", "b"]
        assert all(m["max_model_len"] == 50 and m["sampling_defaults"] == {"temperature": 0.3, "top_k": 5}
                   for m in models)  # fmt: skip
        r = httpx.post(f"{base}/tokenize", json={"model": "b", "messages": [{"role": "user", "content": "hi"}]})
        assert r.json()["tokens"] == Tokenizer(tiny_model_dir).encode("T:hi", add_special_tokens=False)
        assert r.json()["max_model_len"] == 50
        assert httpx.post(f"{base}/ping", timeout=10).status_code == 503  # no decode node answers
        r = httpx.post(f"{base}/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=10)
        assert r.status_code == 404
        r = httpx.post(f"{base}/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 60}, timeout=10)
        assert r.status_code == 400 and "50" in r.json()["error"]["message"]  # the ceiling, before any node
    finally:
        stop(router)


def test_router_refuses_a_bad_chat_template_at_start(tiny_model_dir):
    with pytest.raises(RuntimeError, match="does not compile"):
        start("router", ["--port", str(free_port()), "--model", str(tiny_model_dir), "--chat-template", "{% if %}"])
