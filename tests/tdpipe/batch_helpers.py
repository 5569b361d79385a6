"""What the `pdserve batch` tests share: the prompts, the input lines, the command line, reading
the output, and waiting on the job's stage processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.router_cluster import free_port

PROMPTS = [
    "The old lighthouse keeper",
    "Once upon a time",
    "In the beginning the",
    "A quick brown fox",
    "Water is",
    "The capital of",
]
MAX_TOKENS = 12
START_TIMEOUT = 180  # model load + the first batches on a loaded 2-core machine
STOP_TIMEOUT = 60  # from a signal or a dead stage to the job's exit


def request_line(cid: str, prompt: str, **body) -> str:
    """One input line: a greedy, EOS-ignoring /v1/completions request (`body` overrides)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})


def stop_string_in(text: str) -> str:
    """A 2-character piece of `text` about a third of the way in, free of U+FFFD (half a character):
    the tiny model's text is gibberish, so a stop string that occurs is cut from the engine's own."""
    for start in range(len(text) // 3, len(text) - 2):
        piece = text[start : start + 2]
        if "\ufffd" not in piece and piece.strip():
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def batch_cmd(tmp: Path, *extra: str) -> list[str]:
    """`pdserve batch` from `tmp/in.jsonl` to `tmp/out.jsonl` on a small KV pool, plus `extra`."""
    return [
        sys.executable,
        "-m",
        "pdserve.cli",
        "batch",
        "-i",
        str(tmp / "in.jsonl"),
        "-o",
        str(tmp / "out.jsonl"),
        "--num-kv-blocks",
        "128",
        "--block-size",
        "4",
        *extra,
    ]


def read_results(path: Path) -> list[dict]:
    """The output lines of a job, parsed."""
    return [json.loads(ln) for ln in path.read_bytes().split(b"\n") if ln]  # JSON may hold a raw U+2028


def _code(row: dict) -> str | None:
    """The error code of an output line, whichever of OpenAI's two error shapes it has."""
    if row["error"] is not None:
        return row["error"]["code"]
    if row["response"]["status_code"] != 200:
        return row["response"]["body"]["error"]["code"]
    return None


def texts_by_id(rows: list[dict]) -> dict[str, str]:
    """The generated text of each answered (not refused) request, by custom_id."""
    choices = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in rows if _code(r) is None}
    return {cid: c["text"] if "text" in c else c["message"]["content"] for cid, c in choices.items()}


def stage_pids(batch_pid: int, count: int, deadline: float) -> list[int]:
    """The `pdserve stage` children of a running `pdserve batch`."""
    while time.monotonic() < deadline:
        kids = children_with(batch_pid, "stage")
        if len(kids) == count:
            return kids
        time.sleep(0.1)
    raise AssertionError("the stage processes did not start")


def children_with(pid: int, marker: str) -> list[int]:
    """The pids of `pid`'s children whose command line holds `marker`. A child that exits while they
    are listed (the profile's helper processes end early) is skipped, not a psutil error."""
    psutil = pytest.importorskip("psutil")
    found = []
    for child in psutil.Process(pid).children():
        try:
            if marker in child.cmdline():
                found.append(child.pid)
        except psutil.Error:  # gone, or a zombie not yet reaped
            pass
    return found


def all_gone(pids: list[int], deadline: float) -> bool:
    """Whether every one of `pids` has exited (or is a zombie) by `deadline`."""
    psutil = pytest.importorskip("psutil")
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL a job started with `start_new_session` (its process group), if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start_stage_ranks(model_dir: Path, **env_extra: str) -> tuple[dict[str, str], list[subprocess.Popen]]:
    """`pdserve stage` ranks 1 and 2 started on their own, as the Kubernetes Indexed Job starts them
    (with `env_extra` set, e.g. a PDSERVE_ flag from its ConfigMap), and the rendezvous environment
    (WORLD_SIZE 3) that rank 0 must run with (plus RANK=0)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="3", **env_extra)
    stage = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "stage",
        "--model-dir",
        str(model_dir),
        "--num-kv-blocks",
        "128",
        "--block-size",
        "4",
    ]
    return env, [subprocess.Popen(stage, env=dict(env, RANK=str(r)), stderr=subprocess.DEVNULL) for r in (1, 2)]
