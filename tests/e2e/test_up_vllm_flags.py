"""`pdserve up` with vLLM's serving flags, as a vLLM user would start it: a Hub id from a (fake) HF
cache, several served names, --max-model-len, batch limits, seed, dtype alias, tokenizer, chat template,
generation_config defaults and prompt_tokens_details, each reaching the process that uses it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.e2e.router_cluster import free_port
from tests.e2e.up_process import start_up

pytestmark = pytest.mark.e2e

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\nCUSTOM:{% endif %}"
)


def fake_hub_cache(root: Path, model_dir: Path) -> Path:
    """HF_HOME with `acme/tiny` cached at main; its generation_config.json asks for greedy sampling."""
    snapshot = root / "hub" / "models--acme--tiny" / "snapshots" / ("c" * 40)
    shutil.copytree(model_dir, snapshot)
    gen = json.loads((snapshot / "generation_config.json").read_text())
    (snapshot / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0}))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("c" * 40)
    return snapshot


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.mark.slow  # about a minute on two cores
def test_up_takes_vllm_flags_and_hands_each_to_its_process(tiny_model_dir, tmp_path, monkeypatch):
    snapshot = fake_hub_cache(tmp_path / "hf", tiny_model_dir)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    port, metrics = free_port(), free_port()
    up = start_up(
        [
            "--port",
            str(port),
            "--model",
            "acme/tiny",
            "--tokenizer",
            "acme/tiny",
            "--num-prefill",
            "0",
            "--num-decode",
            "1",
            "--served-model-name",
            "alpha",
            "beta",
            "--max-model-len",
            "100",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--seed",
            "3",
            "--dtype",
            "float",
            "--metrics-base-port",
            str(metrics),
            "--chat-template",
            str(tmp_path / "t.jinja"),
            "--generation-config",
            "auto",
            "--no-enable-prompt-tokens-details",
        ]  # fmt: skip
    )
    proc, lines = up.proc, up.lines
    base = f"http://127.0.0.1:{port}"
    try:
        assert up.wait_up(), "\n".join(lines[-40:])
        assert any("(model: alpha, beta;" in x for x in lines)
        pids = {m[1]: int(m[2]) for x in lines if (m := re.search(r"(\S+): pid (\d+), port", x))}
        node_argv = cmdline(pids["decode-0"])
        expected_flags = {
            "--max-num-seqs": "8",
            "--max-num-batched-tokens": "512",
            "--seed": "3",
            "--dtype": "float32",
            "--model": str(snapshot),
            "--tokenizer": str(snapshot),
        }
        for flag, value in expected_flags.items():
            assert node_argv[node_argv.index(flag) + 1] == value, flag
        assert "--no-enable-prompt-tokens-details" in cmdline(pids["router"])

        # the nodes' --max-model-len is what the router learns and enforces (it has no flag of its own here)
        models = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["alpha", "beta"] and {m["max_model_len"] for m in models} == {100}
        assert models[0]["sampling_defaults"] == {"temperature": 0.0}
        r = httpx.post(f"{base}/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 99}, timeout=30)
        assert r.status_code == 400, r.text
        # the nodes label their metrics with the first served name
        assert 'model_name="alpha"' in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10).text

        # the chat template of --chat-template renders the prompt the router sends
        messages = [{"role": "user", "content": "Hello!"}]
        tokens = httpx.post(f"{base}/tokenize", json={"model": "alpha", "messages": messages}, timeout=10).json()
        expected = Tokenizer(snapshot, TEMPLATE).encode_chat(messages)
        assert tokens["tokens"] == expected and tokens["max_model_len"] == 100

        # generation_config.json's temperature 0 makes a request that sets none greedy: repeatable, and
        # equal to temperature 0 asked for; temperature 1 asked for samples (outputs differ across seeds)
        def text(name: str, **fields) -> str:
            body = {"model": name, "prompt": "The old lighthouse keeper", "max_tokens": 12, **fields}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert "prompt_tokens_details" not in r.json()["usage"]
            assert r.json()["model"] == name
            return r.json()["choices"][0]["text"]

        default = {text("alpha"), text("beta"), text("alpha")}
        assert default == {text("beta", temperature=0)}
        sampled = {text("alpha", temperature=1.0, seed=s) for s in range(4)}
        assert len(sampled) > 1, sampled
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        time.sleep(0.2)


def test_up_with_an_uncached_hub_id_says_how_to_download_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    up = start_up(["--model", "acme/absent", "--port", str(free_port())])
    assert up.proc.wait(60) != 0
    up.up.wait(10)
    out = "\n".join(up.lines)
    assert "huggingface-cli download acme/absent" in out and "Traceback" not in out
