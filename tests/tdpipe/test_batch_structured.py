"""Structured outputs in `pdserve batch`: the pipeline's last stage masks with each line's grammar,
so every constrained line is valid JSON of its schema (and a regex line matches), free lines from
the same prompts almost never are, and a line with a bad schema gets the router's 400."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.e2e.structured_cases import PROMPTS, SCHEMAS, is_valid
from tests.tdpipe.batch_helpers import batch_cmd, read_results, request_line

pytest.importorskip("xgrammar")


def test_batch_lines_match_their_schemas(tmp_path) -> None:
    sampled = {"temperature": 1.0, "ignore_eos": False, "max_tokens": 120}
    lines, schema_of = [], {}
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for j, prompt in enumerate(PROMPTS[:2]):
            cid = f"{name}-{j}"
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
            lines.append(request_line(cid, prompt, seed=i * 10 + j, response_format=fmt, **sampled))
            lines.append(request_line(f"free-{cid}", prompt, seed=i * 10 + j, **{**sampled, "max_tokens": 24}))
            schema_of[cid] = schema_of[f"free-{cid}"] = schema
    lines.append(request_line("re", "Code:", structured_outputs={"regex": "[0-9]{3}-[a-z]{2,4}"}, **sampled))
    # ignore_eos: the line still ends where its grammar completes (the last stage flags it), not at max_tokens
    lines.append(request_line("choice", "Pick:", structured_outputs={"choice": ["yes", "no"]}, max_tokens=50))
    lines.append(request_line("bad", "x", response_format={"type": "json_schema", "json_schema": {"schema": []}}))
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run(batch_cmd(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = {r["custom_id"]: r["response"] for r in read_results(tmp_path / "out.jsonl")}
    assert rows["bad"]["status_code"] == 400
    assert rows["bad"]["body"]["error"]["param"] == "response_format.json_schema"
    choices = {cid: r["body"]["choices"][0] for cid, r in rows.items() if cid != "bad"}
    constrained = {cid: c for cid, c in choices.items() if cid in schema_of and not cid.startswith("free-")}
    bad = {cid: c["text"] for cid, c in constrained.items() if not is_valid(c["text"], schema_of[cid])}
    assert not bad and all(c["finish_reason"] == "stop" for c in constrained.values()), bad
    free = [cid for cid in choices if cid.startswith("free-")]
    assert sum(is_valid(choices[cid]["text"], schema_of[cid]) for cid in free) <= 1  # the control
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", choices["re"]["text"]) and choices["re"]["finish_reason"] == "stop"
    assert json.loads(choices["person-0"]["text"])["role"] in ("admin", "user", "guest")
    assert choices["choice"]["text"] in ("yes", "no") and choices["choice"]["finish_reason"] == "stop"
    assert rows["choice"]["body"]["usage"]["completion_tokens"] < 50
