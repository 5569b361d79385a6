"""AIPerf (NVIDIA's LLM benchmark client, `pip install aiperf` into a venv of its own) as the client
of the serving benchmarks: found, run against one OpenAI-compatible server, its export read back.

AIPerf is kept out of the project venv: it pins its own versions of what pdserve uses. The run is
chat, streaming, fixed input/output lengths, `--use-server-token-count` (a random-weight model's text
does not re-tokenize to the count the server generated) and `ignore_eos` (every request really
produces its output length). The figures come from `profile_export_aiperf.json`, whose metrics are
objects like `{"unit": "ms", "avg": .., "p50": .., "p99": ..}`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "python -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf"


@dataclass(frozen=True)
class Workload:
    """What every arm is sent: `requests` chat requests (after `warmup`), `concurrency` in flight."""

    input_tokens: int = 128
    output_tokens: int = 64
    concurrency: int = 8
    requests: int = 64
    warmup: int = 8
    seed: int = 0


def find_aiperf(explicit: str | None) -> str | None:
    """The `aiperf` executable: `explicit` (a path) if given, else the one on PATH; None if absent."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("aiperf")


def request_form(aiperf: str, url: str, model: str, tokenizer: str) -> list[str]:
    """`aiperf profile` with the request form every benchmark here sends (chat, streaming, server
    token counts, `ignore_eos`; see the module doc); callers add the load and the artifact dir."""
    cmd = [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming"]
    return cmd + ["--use-server-token-count", "--tokenizer", tokenizer, "--extra-inputs", "ignore_eos:true"]


def local_tokenizer_env() -> dict[str, str]:
    """This environment for an AIPerf given a local tokenizer directory: its offline mode looks such
    a directory up as a Hub id and fails, and a local path needs no network, so the offline switches
    are dropped."""
    return {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


def profile(
    aiperf: str, url: str, model: str, tokenizer: str, work: Workload, timeout: float = 1800, keep: Path | None = None
) -> dict:
    """Run one AIPerf profile against `url` (served name `model`) and return its figures: output
    tok/s, TTFT and ITL p50/p99 in ms, completed and failed requests. RuntimeError when it fails.
    `keep`: copy AIPerf's artifacts there (per-request records: `profile_export.jsonl`)."""
    with tempfile.TemporaryDirectory(prefix="aiperf-") as out:
        cmd = request_form(aiperf, url, model, tokenizer)
        cmd += ["--prompt-input-tokens-mean", str(work.input_tokens), "--prompt-input-tokens-stddev", "0"]
        cmd += ["--prompt-output-tokens-mean", str(work.output_tokens), "--prompt-output-tokens-stddev", "0"]
        cmd += ["--concurrency", str(work.concurrency), "--request-count", str(work.requests)]
        cmd += ["--warmup-request-count", str(work.warmup), "--random-seed", str(work.seed)]
        cmd += ["--output-artifact-dir", out, "--ui-type", "none", "--no-server-metrics"]
        run = subprocess.run(cmd, capture_output=True, text=True, env=local_tokenizer_env(), timeout=timeout)
        export = Path(out) / "profile_export_aiperf.json"
        if keep is not None:
            shutil.copytree(out, keep, dirs_exist_ok=True)
        if run.returncode != 0 or not export.exists():
            tail = (run.stdout + run.stderr).strip().splitlines()[-15:]
            raise RuntimeError(f"aiperf failed (exit {run.returncode}):\n" + "\n".join(tail))
        return figures(json.loads(export.read_text()))


def figures(export: dict) -> dict:
    """The figures the comparison uses, from a `profile_export_aiperf.json` document."""

    def stat(name: str, key: str) -> float:
        metric = export.get(name) or {}
        return float(metric.get(key, float("nan")))

    completed = stat("completed_request_count", "avg")
    error_rate = stat("request_error_rate", "avg")
    return {
        "tok_s": stat("output_token_throughput", "avg"),
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "ttft_p99_ms": stat("time_to_first_token", "p99"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "itl_p99_ms": stat("inter_token_latency", "p99"),
        "output_len": stat("output_sequence_length", "avg"),
        "completed": int(completed) if completed == completed else 0,  # NaN: none reported
        "error_rate_pct": error_rate if error_rate == error_rate else 0.0,
    }
