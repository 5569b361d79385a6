"""AIPerf as benchmarks/goodput.py's load generator: one fresh `aiperf profile` per rate, open loop
(Poisson arrivals at `--request-rate`, or a Mooncake-format trace on its own timestamps with
`--fixed-schedule`), its per-request records (`profile_export.jsonl`) read back.

It adds rate and trace modes to benchmarks/aiperf_client.py (fixed concurrency) by composition: the
same executable lookup and the same request form (chat, streaming, server token counts, `ignore_eos`
so every request really produces its output length), and TTFT/TPOT computed per request here
(benchmarks/goodput_slo.py) rather than read from AIPerf's aggregates.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.aiperf_client import local_tokenizer_env, request_form
from benchmarks.goodput_load import ScaledTrace


@dataclass(frozen=True)
class Client:
    """Where AIPerf runs and what it talks to: one server's base URL, its served model name, and the
    tokenizer AIPerf builds prompts with."""

    aiperf: str
    url: str
    model: str
    tokenizer: str
    request_timeout_s: float
    """A request still running after this is cut and counted a miss (no SLO can be met past it)."""
    artifacts: Path | None = None
    """Keep each run's AIPerf artifacts under DIR/<label> (None: a temporary folder, removed)."""
    hub_cache: Path | None = None
    """A Hugging Face cache holding `tokenizer` as a Hub id (`local_hub_cache`): AIPerf then runs offline."""


HUB_ID = "pdserve/goodput-tokenizer"
_SNAPSHOT = "0" * 40


def local_hub_cache(model_dir: Path, root: Path) -> Path:
    """A throwaway Hugging Face cache under `root` that holds `model_dir` as the Hub id `HUB_ID`.

    AIPerf's trace loaders tokenize in worker processes that force offline mode, and offline AIPerf
    looks any tokenizer name up as a Hub id in the cache: a local directory fails there (aiperf
    0.13.0, `parallel_decode._init_worker`). Given a cache that holds the model as a Hub id (links to
    its files, no copy), every AIPerf process finds it offline, with no network."""
    repo = root / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / _SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if not (snapshot / f.name).exists():
            (snapshot / f.name).symlink_to(f.resolve())
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(_SNAPSHOT)
    return root


def base_command(c: Client, out: str) -> list[str]:
    cmd = request_form(c.aiperf, c.url, c.model, c.tokenizer)
    cmd += ["--request-timeout-seconds", f"{c.request_timeout_s:g}"]
    cmd += ["--output-artifact-dir", out, "--ui-type", "none", "--no-server-metrics"]
    return cmd


def poisson_args(rate: float, requests: int, input_tokens: int, output_tokens: int, seed: int) -> list[str]:
    """`requests` chat requests, Poisson arrivals at `rate` req/s, fixed lengths."""
    return [
        *("--request-rate", f"{rate:g}", "--arrival-pattern", "poisson", "--request-count", str(requests)),
        *("--prompt-input-tokens-mean", str(input_tokens), "--prompt-input-tokens-stddev", "0"),
        *("--prompt-output-tokens-mean", str(output_tokens), "--prompt-output-tokens-stddev", "0"),
        *("--random-seed", str(seed)),
    ]


def warmup_args(requests: int, input_tokens: int, output_tokens: int, seed: int) -> list[str]:
    """The warm-up every target gets once it is up: `requests` requests, two at a time."""
    return [
        *("--concurrency", "2", "--request-count", str(requests)),
        *("--prompt-input-tokens-mean", str(input_tokens), "--prompt-input-tokens-stddev", "0"),
        *("--prompt-output-tokens-mean", str(output_tokens), "--prompt-output-tokens-stddev", "0"),
        *("--random-seed", str(seed)),
    ]


def trace_args(trace_file: Path, trace: ScaledTrace, seed: int) -> list[str]:
    """Replay `trace_file` (written from `trace`) on its timestamps, from its first request."""
    return [
        *("--input-file", str(trace_file), "--custom-dataset-type", "mooncake_trace"),
        *("--fixed-schedule", "--fixed-schedule-auto-offset"),
        *("--prompt-input-tokens-block-size", str(trace.block_size), "--random-seed", str(seed)),
    ]


def write_trace(trace: ScaledTrace, path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in trace.records))
    return path


def run(c: Client, load: list[str], label: str, timeout_s: float) -> list[dict]:
    """One `aiperf profile` with `load`'s flags; its per-request records (every phase). RuntimeError
    with AIPerf's last lines when it fails or writes no records."""
    with tempfile.TemporaryDirectory(prefix="aiperf-goodput-") as out:
        if c.hub_cache is not None:
            env = {**os.environ, "HF_HUB_CACHE": str(c.hub_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        else:
            env = local_tokenizer_env()
        done = subprocess.run(base_command(c, out) + load, capture_output=True, text=True, env=env, timeout=timeout_s)
        if c.artifacts is not None:
            shutil.copytree(out, c.artifacts / label, dirs_exist_ok=True)
        records = Path(out) / "profile_export.jsonl"
        if done.returncode != 0 or not records.exists():
            lines = (done.stdout + done.stderr).strip().splitlines()
            log = Path(out) / "logs" / "aiperf.log"
            # its last line names only its log file: the log's first error line says what went wrong
            logged = log.read_text(errors="replace").splitlines() if log.exists() else []
            cause = next((line for line in lines + logged if "Error" in line), "")
            raise RuntimeError(f"aiperf failed (exit {done.returncode}):\n" + "\n".join(lines[-15:] + [cause]))
        return [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
