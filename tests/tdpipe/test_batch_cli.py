"""`pdserve batch` on the tiny model with 2 stages: texts equal engine.LLM's, OpenAI-shaped error
lines, resume keys, the refusals before a job starts, --cost-table, --help.

Processes listen on 127.0.0.1 only; every test stops what it started and polls with deadlines
(generous: the CI machine has 2 loaded cores), never asserting speed.
"""

from __future__ import annotations

import io
import json
import subprocess

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.tdpipe.batch_helpers import MAX_TOKENS, PROMPTS, batch_cmd, read_results, request_line, texts_by_id


def _run_with_stats(tmp_path) -> subprocess.CompletedProcess:
    """The job on tmp_path/in.jsonl with --stats and a profile cache of this test's own."""
    cmd = batch_cmd(tmp_path, "--stats", str(tmp_path / "stats.json"), "--profile-cache", str(tmp_path / "profiles"))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_batch_texts_equal_llm_and_bad_lines_become_errors(tmp_path, batch_expected, tiny_model_dir) -> None:
    envelope = {  # not a request at all: `"response": null, "error": {code, message, line}`
        "{not json": "invalid_json",
        "[1, 2]": "invalid_json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}): "missing_custom_id",
        json.dumps(
            {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x", "temperature": 0}}
        ): "invalid_method",
        json.dumps({"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {}}): "invalid_url",
        request_line("r0", "duplicate id"): "duplicate_custom_id",
    }
    refused = {  # a request the endpoint refuses: `"response": {"status_code": 400, ...}, "error": null`
        json.dumps(
            {
                "custom_id": "nob",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"max_tokens": 2, "temperature": 0},
            }
        ): "invalid_body",
        request_line("many", "two choices", n=2): "unsupported_parameter",
        request_line("ids", "token ids", return_token_ids=True): "unsupported_parameter",
        request_line("long", "word " * 600): "prompt_too_long",  # over the pipeline's KV (128 x 4 tokens)
        request_line("ctx", "hello", max_tokens=5000): "context_length_exceeded",  # over the model's context
    }
    chat = json.dumps(
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
    )
    good = [request_line(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    hot = request_line("hot", "sampled", temperature=0.8, top_p=0.9, seed=3)  # the last stage samples like the engine
    lines = good[:2] + list(envelope) + good[2:] + [chat, hot, ""] + list(refused)  # a blank line is skipped
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = _run_with_stats(tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = read_results(tmp_path / "out.jsonl")
    assert len(rows) == len(lines) - 1
    assert all(set(r) == {"id", "custom_id", "response", "error"} and r["id"].startswith("batch_req_") for r in rows)
    sampled = LLM(tiny_model_dir).generate(
        "sampled", SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    )
    assert texts_by_id(rows) == {**batch_expected, "chat": texts_by_id(rows)["chat"], "hot": sampled[0].outputs[0].text}

    by_line = {r["error"]["line"]: r for r in rows if r["error"]}
    assert len(by_line) == len(envelope)
    for text, code in envelope.items():
        row = by_line[lines.index(text) + 1]  # `line` is the 1-based input line
        assert row["response"] is None and row["error"]["code"] == code and row["error"]["message"]
    assert by_line[lines.index(request_line("r0", "duplicate id")) + 1]["custom_id"] == "r0"

    answered = {r["custom_id"]: r for r in rows if r["response"] is not None}
    for text, code in refused.items():
        row = answered[json.loads(text)["custom_id"]]
        assert row["error"] is None and row["response"]["status_code"] == 400
        assert row["response"]["request_id"]
        # the router's HTTP 400 body
        assert row["response"]["body"] == {
            "error": {
                "message": row["response"]["body"]["error"]["message"],
                "type": "invalid_request_error",
                "param": row["response"]["body"]["error"]["param"],
                "code": code,
            }
        }
    assert answered["nob"]["response"]["body"]["error"]["param"] == "prompt"

    ok = answered["r0"]["response"]
    assert ok["status_code"] == 200 and ok["request_id"] == ok["body"]["id"]
    assert set(ok["body"]) == {"id", "object", "created", "model", "choices", "usage"}
    assert ok["body"]["object"] == "text_completion"
    assert ok["body"]["choices"] == [
        {"index": 0, "text": batch_expected["r0"], "logprobs": None, "finish_reason": "length"}
    ]
    assert ok["body"]["usage"]["completion_tokens"] == MAX_TOKENS
    c = answered["chat"]["response"]["body"]
    assert c["object"] == "chat.completion" and c["id"].startswith("chatcmpl-")
    assert c["choices"][0]["message"]["role"] == "assistant" and c["choices"][0]["finish_reason"] == "length"
    assert c["usage"]["completion_tokens"] == 5

    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["completed"] == len(PROMPTS) + 2 and stats["errors"] == len(envelope) + len(refused)
    assert stats["output_tokens"] == MAX_TOKENS * (len(PROMPTS) + 1) + 5  # the prompts, "hot", "chat"
    assert {"output_tokens_per_s", "phase_switches", "bubble_fraction", "preemptions"} <= set(stats)
    assert stats["cost_table"] == "profiled"  # auto: local CPU stages are profiled before the job
    assert 0 < stats["profile_seconds"] < stats["seconds"]
    assert "cost table: profiled 2 stage(s)" in proc.stderr
    assert stats["profile_cached"] is False

    # a rerun on the same model, dtype, device and stages takes the cached profile (a smaller job: covered)
    (tmp_path / "in.jsonl").write_text("\n".join(good[:2]) + "\n")
    (tmp_path / "out.jsonl").unlink()
    again = _run_with_stats(tmp_path)
    assert again.returncode == 0, again.stderr
    assert "cost table: reused the stage profile cached in" in again.stderr, again.stderr
    assert json.loads((tmp_path / "stats.json").read_text())["profile_cached"] is True
    assert texts_by_id(read_results(tmp_path / "out.jsonl")) == {k: batch_expected[k] for k in ("r0", "r1")}


def test_resume_keys_skip_answered_lines_and_keep_duplicates_apart(tmp_path, tiny_model_dir) -> None:
    """A duplicate's error line carries the repeated custom_id: on resume it must not count as the
    answer of the line that owns that id; error lines without an id are matched by line number."""
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.openai_api.choices import ChoiceBuilder
    from pdserve.tdpipe.runtime.batch_input import read_lines
    from pdserve.tdpipe.runtime.batch_output import OrderedWriter, open_output
    from pdserve.tdpipe.runtime.batch_stream import LineSource

    data = "\n".join([request_line("a", "x"), request_line("a", "again"), "{bad", request_line("b", "y")]).encode()
    tok = Tokenizer(str(tiny_model_dir))

    def plan(output: str) -> tuple[list[str], list[dict], int]:
        path = tmp_path / "out.jsonl"
        path.write_text(output)
        f, done = open_output(str(path), resume=True)
        f.close()
        out = io.BytesIO()
        src = LineSource(
            read_lines(io.BytesIO(data)),
            ChoiceBuilder(tok, lambda: 4096),
            tok,
            "m",
            OrderedWriter(out, "completion"),  # input order would hold the errors behind "a"
            done,
            window=16,
            capacity=512,
        )
        todo = []
        while (req := src.pull()) is not None:
            todo.append(req.request_id)
        return sorted(todo), [json.loads(x) for x in out.getvalue().splitlines()], src.skipped

    # nothing answered yet: both requests run, the duplicate (line 2) and the bad JSON (line 3) are errors
    todo, errors, _ = plan("")
    assert todo == ["a", "b"] and len(errors) == 2
    # killed before any result: both requests still run, the error lines are not repeated
    assert plan("".join(json.dumps(r) + "\n" for r in errors)) == (["a", "b"], [], 2)
    # "a" answered, plus a line torn by the kill: "a" is skipped, the error lines are written again
    # (they were not in the output), and the torn tail is cut off the file
    answered_a = json.dumps({"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 200}, "error": None})
    todo, written, skipped = plan(answered_a + "\n" + '{"id": "batch_req_2", "custom_id": "b", "resp')
    assert (todo, skipped) == (["b"], 1)
    assert [(r["custom_id"], r["error"]["code"], r["error"]["line"]) for r in written] == [
        ("a", "duplicate_custom_id", 2),
        (None, "invalid_json", 3),
    ]
    assert (tmp_path / "out.jsonl").read_text() == answered_a + "\n"


def test_batch_refuses_to_overwrite_results_without_resume(tmp_path, capsys) -> None:
    from pdserve.cli import main

    (tmp_path / "in.jsonl").write_text(request_line("a", "x") + "\n")
    (tmp_path / "out.jsonl").write_text('{"id": "batch_req_1", "custom_id": "a"}\n')
    assert main(batch_cmd(tmp_path)[3:]) == 2
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_text() == '{"id": "batch_req_1", "custom_id": "a"}\n'


def test_cost_table_choices(tmp_path, capsys) -> None:
    from pdserve.cli import main
    from pdserve.tdpipe.runtime.batch_job import table_choice
    from pdserve.tdpipe.cost_table import CostTable

    assert table_choice("auto", "cpu", external=False) == "profile"
    # a GPU, or stages on hardware this process may not share: the GPU-shaped analytic table
    assert table_choice("auto", "cuda", external=False).name == "analytic-gpu"
    assert table_choice("auto", "cpu", external=True).name == "analytic-gpu"
    assert table_choice("profile", "cuda:1", external=False) == "profile"
    with pytest.raises(ValueError, match="--external-stages"):
        table_choice("profile", "cpu", external=True)
    csv = tmp_path / "mine.csv"
    csv.write_text("Total Length,Execute Time\n1,10.0\n64,20.0\n")
    table = table_choice(str(csv), "cpu", external=False)
    assert isinstance(table, CostTable) and table.name == "mine" and table.tokens == (1, 64)
    for bad, why in ((str(tmp_path / "missing.csv"), "cannot read"), ("no-such-table", "unknown cost table")):
        with pytest.raises(ValueError, match=why):
            table_choice(bad, "cpu", external=False)
    (tmp_path / "broken.csv").write_text("tokens,ms\n1,2\n")
    with pytest.raises(ValueError, match="cannot read"):
        table_choice(str(tmp_path / "broken.csv"), "cpu", external=False)
    # the CLI refuses a bad table before it reads the input or writes anything
    (tmp_path / "in.jsonl").write_text(request_line("a", "x") + "\n")
    assert main(batch_cmd(tmp_path, "--cost-table", "no-such-table")[3:]) == 2
    assert "unknown cost table 'no-such-table'" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_batch_help_lists_every_flag() -> None:
    from pdserve.cli import build_parser

    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    parser = sub.choices["batch"]
    text = parser.format_help()
    flags = [opt for a in parser._actions for opt in a.option_strings]
    assert {
        "--input",
        "--output",
        "--model",
        "--stages",
        "--policy",
        "--resume",
        "--stats",
        "--external-stages",
        "--num-kv-blocks",
        "--block-size",
        "--max-batch-tokens",
        "--device",
        "--attention-backend",
        "--cost-table",
        "--dtype",
        "--num-threads",
        "--init-timeout",
        "--heartbeat-timeout",
        "--length-predictor",
        "--profile-cache",
        "--tensor-parallel-size",
    } <= set(flags)
    assert all(flag in text for flag in flags)
    assert all(a.help for a in parser._actions), [a.option_strings for a in parser._actions if not a.help]


@pytest.mark.parametrize("policy", ["pp-sb", "pp-hb"])
def test_the_pp_baselines_answer_every_line(tmp_path, batch_expected, policy) -> None:
    """`pdserve batch --policy pp-sb|pp-hb` once read the input ahead and then split the feed
    between its virtual engines, which drew only from behind what was read: every line went
    unanswered and the job exited 0. Now each line is answered, and a job that ends with lines
    read but never run fails instead."""
    lines = [request_line(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    cmd = batch_cmd(tmp_path, "--policy", policy, "--profile-cache", str(tmp_path / "profiles"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert texts_by_id(read_results(tmp_path / "out.jsonl")) == batch_expected
