"""`pdserve batch` end to end on the tiny model with 2 stages: texts, error lines, kill + --resume, --help."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

PROMPTS = ["The old lighthouse keeper", "Once upon a time", "In the beginning the", "A quick brown fox",
           "Water is", "The capital of"]
MAX_TOKENS = 12


def _line(cid: str, prompt: str, **body) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})


def _cmd(tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "batch", "-i", str(tmp / "in.jsonl"), "-o", str(tmp / "out.jsonl"),
            "--stages", "2", "--num-kv-blocks", "128", "--block-size", "4", *extra]


def _results(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> dict[str, str]:
    outs = LLM(tiny_model_dir).generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                ignore_eos=True))
    return {f"r{i}": o.outputs[0].text for i, o in enumerate(outs)}


def test_batch_texts_equal_llm_and_bad_lines_become_errors(tmp_path, expected) -> None:
    bad = ["{not json", _line("r0", "duplicate id"), _line("hot", "sampled", temperature=0.8),
           json.dumps({"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {}}),
           json.dumps({"custom_id": "nob", "method": "POST", "url": "/v1/completions", "body": {"max_tokens": 2}}),
           _line("long", "word " * 600)]
    lines = [_line(f"r{i}", p) for i, p in enumerate(PROMPTS)] + bad
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run(_cmd(tmp_path, "--stats", str(tmp_path / "stats.json")), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    rows = _results(tmp_path / "out.jsonl")
    assert len(rows) == len(lines)
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in rows if r["response"]}
    assert texts == expected
    errors = {r["custom_id"]: r["error"]["code"] for r in rows if r["error"]}
    assert errors == {None: "invalid_json", "r0": "duplicate_custom_id", "hot": "unsupported_sampling",
                      "u": "invalid_url", "nob": "invalid_body", "long": "prompt_too_long"}
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["completed"] == len(PROMPTS) and stats["errors"] == len(bad)
    assert stats["output_tokens"] == MAX_TOKENS * len(PROMPTS)


@pytest.mark.slow  # ~25 s: a tiny-model job run twice (plus a reference run of engine.LLM)
def test_batch_killed_then_resumed_answers_each_id_once(tmp_path, tiny_model_dir) -> None:
    # staggered lengths: requests retire one by one, so the kill after the first result lands mid-job
    lengths = {f"r{i}": 2 + 10 * i for i in range(len(PROMPTS))}
    llm = LLM(tiny_model_dir)
    expected = {cid: llm.generate(PROMPTS[i], SamplingParams(max_tokens=lengths[cid], temperature=0.0,
                                                            ignore_eos=True))[0].outputs[0].text
                for i, cid in enumerate(lengths)}
    (tmp_path / "in.jsonl").write_text("\n".join(_line(cid, PROMPTS[i], max_tokens=n)
                                                 for i, (cid, n) in enumerate(lengths.items())) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_cmd(tmp_path), stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n")):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the job and its stage processes, as a crash would
    proc.wait()
    assert 0 < len(out.read_text().splitlines()) < len(PROMPTS), "the kill should land mid-job"
    with out.open("a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "r')  # a line torn by the kill
    resumed = subprocess.run(_cmd(tmp_path, "--resume"), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    rows = _results(out)
    ids = [r["custom_id"] for r in rows]
    assert sorted(ids) == sorted(expected)
    assert {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in rows} == expected


def test_batch_help_lists_every_flag() -> None:
    from pdserve.cli import build_parser
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    parser = sub.choices["batch"]
    text = parser.format_help()
    flags = [opt for a in parser._actions for opt in a.option_strings]
    assert {"--input", "--output", "--model", "--stages", "--policy", "--resume", "--stats", "--device"} <= set(flags)
    assert all(flag in text for flag in flags)
