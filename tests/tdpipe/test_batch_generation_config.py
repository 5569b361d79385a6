"""`pdserve batch` applies the model's generation_config.json defaults to fields a line leaves unset,
as the router does (`--generation-config auto`, the default) and as vLLM's run-batch does.

The job runs as a subprocess (local stages) with a bounded timeout."""

from __future__ import annotations

import json
import shutil
import subprocess

from tests.tdpipe.batch_helpers import batch_cmd, read_results


def test_generation_config_max_new_tokens_is_the_default_of_lines_without_max_tokens(tmp_path, tiny_model_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0}))
    body = {"prompt": "The old lighthouse", "ignore_eos": True}  # neither max_tokens nor temperature
    lines = [
        {"custom_id": "unset", "method": "POST", "url": "/v1/completions", "body": body},
        {"custom_id": "set", "method": "POST", "url": "/v1/completions", "body": {**body, "max_tokens": 5}},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cmd = batch_cmd(tmp_path, "--model", str(model), "--cost-table", "analytic")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    usage = {
        r["custom_id"]: r["response"]["body"]["usage"]["completion_tokens"]
        for r in read_results(tmp_path / "out.jsonl")
    }
    assert usage == {"unset": 3, "set": 5}  # without the file the completions default would be 16

    (tmp_path / "out.jsonl").unlink()
    proc = subprocess.run(cmd + ["--generation-config", "vllm"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    usage = {
        r["custom_id"]: r["response"]["body"]["usage"]["completion_tokens"]
        for r in read_results(tmp_path / "out.jsonl")
    }
    assert usage["unset"] == 16 and usage["set"] == 5  # `vllm` ignores the file: OpenAI's completions default
