"""`pdserve batch` on the tiny model with 2 stages: texts, OpenAI-shaped error lines, resume keys,
signals, a dead stage, external stages, --help.

Processes listen on 127.0.0.1 only; every test stops what it started and polls with deadlines
(generous: the CI machine has 2 loaded cores), never asserting speed.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

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


def _line(cid: str, prompt: str, **body) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **body}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})


def _cmd(tmp: Path, *extra: str) -> list[str]:
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


def _results(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def _code(row: dict) -> str | None:
    """The error code of an output line, whichever of OpenAI's two error shapes it has."""
    if row["error"] is not None:
        return row["error"]["code"]
    if row["response"]["status_code"] != 200:
        return row["response"]["body"]["error"]["code"]
    return None


def _texts(rows: list[dict]) -> dict[str, str]:
    choices = {r["custom_id"]: r["response"]["body"]["choices"][0] for r in rows if _code(r) is None}
    return {cid: c["text"] if "text" in c else c["message"]["content"] for cid, c in choices.items()}


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> dict[str, str]:
    outs = LLM(tiny_model_dir).generate(
        PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    return {f"r{i}": o.outputs[0].text for i, o in enumerate(outs)}


def test_batch_texts_equal_llm_and_bad_lines_become_errors(tmp_path, expected, tiny_model_dir) -> None:
    envelope = {  # not a request at all: `"response": null, "error": {code, message, line}`
        "{not json": "invalid_json",
        "[1, 2]": "invalid_json",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}): "missing_custom_id",
        json.dumps(
            {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x", "temperature": 0}}
        ): "invalid_method",
        json.dumps({"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {}}): "invalid_url",
        _line("r0", "duplicate id"): "duplicate_custom_id",
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
        _line("many", "two choices", n=2): "unsupported_parameter",
        _line("long", "word " * 600): "prompt_too_long",  # over the pipeline's KV (128 x 4 tokens)
        _line("ctx", "hello", max_tokens=5000): "context_length_exceeded",  # over the model's context
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
    good = [_line(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    hot = _line("hot", "sampled", temperature=0.8, top_p=0.9, seed=3)  # the last stage samples like the engine
    lines = good[:2] + list(envelope) + good[2:] + [chat, hot, ""] + list(refused)  # a blank line is skipped
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        _cmd(tmp_path, "--stats", str(tmp_path / "stats.json")), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    rows = _results(tmp_path / "out.jsonl")
    assert len(rows) == len(lines) - 1
    assert all(set(r) == {"id", "custom_id", "response", "error"} and r["id"].startswith("batch_req_") for r in rows)
    sampled = LLM(tiny_model_dir).generate(
        "sampled", SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    )
    assert _texts(rows) == {**expected, "chat": _texts(rows)["chat"], "hot": sampled[0].outputs[0].text}

    by_line = {r["error"]["line"]: r for r in rows if r["error"]}
    assert len(by_line) == len(envelope)
    for text, code in envelope.items():
        row = by_line[lines.index(text) + 1]  # `line` is the 1-based input line
        assert row["response"] is None and row["error"]["code"] == code and row["error"]["message"]
    assert by_line[lines.index(_line("r0", "duplicate id")) + 1]["custom_id"] == "r0"

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
    assert ok["body"]["choices"] == [{"index": 0, "text": expected["r0"], "logprobs": None, "finish_reason": "length"}]
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


def test_resume_keys_skip_answered_lines_and_keep_duplicates_apart(tmp_path, tiny_model_dir) -> None:
    """A duplicate's error line carries the repeated custom_id: on resume it must not count as the
    answer of the line that owns that id; error lines without an id are matched by line number."""
    from engine.tokenizer import Tokenizer
    from pdserve.commands.batch import _done_keys
    from pdserve.commands.batch_job import BatchJob

    lines = list(enumerate([_line("a", "x"), _line("a", "again"), "{bad", _line("b", "y")], start=1))
    args = Namespace(num_kv_blocks=128, block_size=4)
    tok = Tokenizer(str(tiny_model_dir))

    def plan(output: str) -> tuple[list[str], list[dict], int]:
        path = tmp_path / "out.jsonl"
        path.write_text(output)
        out = io.StringIO()
        job = BatchJob(args, str(tiny_model_dir), "cpu", tok, 4096, out)
        items = job.plan(lines, _done_keys(str(path)))
        return sorted(items), [json.loads(x) for x in out.getvalue().splitlines()], job.skipped

    first_out = io.StringIO()
    first = BatchJob(args, str(tiny_model_dir), "cpu", tok, 4096, first_out)
    assert sorted(first.plan(lines, set())) == ["a", "b"]
    errors = first_out.getvalue()  # the duplicate (line 2) and the bad JSON (line 3)
    # killed before any result: both requests still run, the error lines are not repeated
    assert plan(errors) == (["a", "b"], [], 2)
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


def _stage_pids(batch_pid: int, count: int, deadline: float) -> list[int]:
    """The `pdserve stage` children of a running `pdserve batch`."""
    psutil = pytest.importorskip("psutil")
    while time.monotonic() < deadline:
        kids = [p for p in psutil.Process(batch_pid).children() if "stage" in p.cmdline()]
        if len(kids) == count:
            return [p.pid for p in kids]
        time.sleep(0.1)
    raise AssertionError("the stage processes did not start")


def _gone(pids: list[int], deadline: float) -> bool:
    psutil = pytest.importorskip("psutil")
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _start_mid_run(tmp_path: Path, llm_dir) -> tuple[subprocess.Popen, list[int], dict[str, str]]:
    """Start a job whose requests retire one by one; return it once the first result is written."""
    # staggered lengths: requests retire one by one, so what comes after the first result lands mid-job
    lengths = {f"r{i}": 2 + 10 * i for i in range(len(PROMPTS))}
    llm = LLM(llm_dir)
    expected = {
        cid: llm.generate(PROMPTS[i], SamplingParams(max_tokens=lengths[cid], temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
        .text
        for i, cid in enumerate(lengths)
    }
    del llm
    (tmp_path / "in.jsonl").write_text(
        "\n".join(_line(cid, PROMPTS[i], max_tokens=n) for i, (cid, n) in enumerate(lengths.items())) + "\n"
    )
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_cmd(tmp_path), stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT
    stages = _stage_pids(proc.pid, 2, deadline)
    while proc.poll() is None and time.monotonic() < deadline and not (out.exists() and out.read_text().count("\n")):
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be interrupted"
    return proc, stages, expected


def _finish_and_check(tmp_path: Path, expected: dict[str, str]) -> None:
    out = tmp_path / "out.jsonl"
    assert 0 < len(out.read_text().splitlines()) < len(PROMPTS), "the interruption should land mid-job"
    resumed = subprocess.run(_cmd(tmp_path, "--resume"), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    rows = _results(out)
    assert sorted(r["custom_id"] for r in rows) == sorted(expected)  # each exactly once
    assert _texts(rows) == expected


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.slow  # 35-80 s: a tiny-model job run twice plus engine.LLM for the reference texts
def test_batch_killed_then_resumed_answers_each_id_once(tmp_path, tiny_model_dir) -> None:
    proc, stages, expected = _start_mid_run(tmp_path, tiny_model_dir)
    try:
        proc.kill()  # SIGKILL the job alone, as a crash would: its stages must not outlive it
        proc.wait(timeout=STOP_TIMEOUT)
        assert _gone(stages, time.monotonic() + STOP_TIMEOUT), "stage processes outlived a killed job"
    finally:
        _stop(proc)
    with (tmp_path / "out.jsonl").open("a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "r')  # a line torn by the kill
    _finish_and_check(tmp_path, expected)


@pytest.mark.slow  # 35-80 s: as above
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_batch_stopped_by_signal_stops_its_stages_and_resumes(tmp_path, tiny_model_dir, sig) -> None:
    proc, stages, expected = _start_mid_run(tmp_path, tiny_model_dir)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=STOP_TIMEOUT)
        assert proc.returncode == 128 + sig, err
        assert "--resume" in err
        assert _gone(stages, time.monotonic() + STOP_TIMEOUT), "stage processes left behind"
    finally:
        _stop(proc)
    _finish_and_check(tmp_path, expected)


@pytest.mark.slow  # 35-80 s: as above
def test_batch_names_a_killed_stage_then_resumes(tmp_path, tiny_model_dir) -> None:
    proc, stages, expected = _start_mid_run(tmp_path, tiny_model_dir)
    try:
        os.kill(stages[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=STOP_TIMEOUT)  # no hang: the job notices within the timeout
        assert proc.returncode == 1, err
        assert f"pipeline stage died: stage rank 2 (pid {stages[1]}) was killed by SIGKILL" in err, err
        assert _gone(stages, time.monotonic() + STOP_TIMEOUT), "the surviving stage was left behind"
    finally:
        _stop(proc)
    _finish_and_check(tmp_path, expected)


WATCHDOG_SCRIPT = """
import subprocess, sys, threading
import pdserve.commands.batch_watchdog as bj
bj.HARD_EXIT_GRACE_S = 1.0
wd = bj.StageWatchdog()
wd.install()
stages = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
wd.watch(stages)
print(" ".join(str(p.pid) for p in stages), flush=True)
lock = threading.Lock()
lock.acquire()
lock.acquire()  # a main thread that never returns to Python, like one stuck in a gloo receive
"""


def test_watchdog_ends_a_job_whose_main_thread_stays_blocked() -> None:
    """The last resort: a stage died and the main thread does not unwind. The watchdog stops the
    other stages and ends the process with exit 1, naming the dead stage."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCHDOG_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, proc.stderr.read()
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=STOP_TIMEOUT)
        assert proc.returncode == 1, err
        assert f"stage rank 2 (pid {pids[1]}) was killed by SIGKILL" in err and "--resume" in err, err
        assert _gone(pids, time.monotonic() + STOP_TIMEOUT), "the other stage was left running"
    finally:
        _stop(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~25 s: three processes load torch and the model
def test_batch_external_stages_runs_as_rank_0(tmp_path, tiny_model_dir, expected) -> None:
    """`pdserve stage` ranks started separately (as the Kubernetes Indexed Job does) + `pdserve batch
    --external-stages` as rank 0: same texts as engine.LLM."""
    (tmp_path / "in.jsonl").write_text("\n".join(_line(f"r{i}", p) for i, p in enumerate(PROMPTS)) + "\n")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="3")
    stage = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "stage",
        "--model-dir",
        str(tiny_model_dir),
        "--num-kv-blocks",
        "128",
        "--block-size",
        "4",
    ]
    stages = [subprocess.Popen(stage, env=dict(env, RANK=str(r)), stderr=subprocess.DEVNULL) for r in (1, 2)]
    try:
        proc = subprocess.run(
            _cmd(tmp_path, "--external-stages", "--model", str(tiny_model_dir)),
            env=dict(env, RANK="0"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert "stages=2" in proc.stderr  # from WORLD_SIZE
        for s in stages:
            assert s.wait(timeout=STOP_TIMEOUT) == 0  # the controller's shutdown ends them
    finally:
        for s in stages:
            if s.poll() is None:
                s.kill()
                s.wait()
    assert _texts(_results(tmp_path / "out.jsonl")) == expected


@pytest.mark.slow  # ~30 s: as above, with long requests
def test_batch_external_stages_stops_when_a_remote_stage_dies(tmp_path, tiny_model_dir) -> None:
    """A stage the controller did not start dies mid-job: no hang, exit 1, what was written stays."""
    (tmp_path / "in.jsonl").write_text(
        "\n".join(_line(f"r{i}", p, max_tokens=2 + 40 * i) for i, p in enumerate(PROMPTS)) + "\n"
    )
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="3")
    stage = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "stage",
        "--model-dir",
        str(tiny_model_dir),
        "--num-kv-blocks",
        "128",
        "--block-size",
        "4",
    ]
    stages = [subprocess.Popen(stage, env=dict(env, RANK=str(r)), stderr=subprocess.DEVNULL) for r in (1, 2)]
    proc = subprocess.Popen(
        _cmd(tmp_path, "--external-stages", "--model", str(tiny_model_dir)),
        env=dict(env, RANK="0"),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out = tmp_path / "out.jsonl"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline and not (out.exists() and out.read_text()):
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before the stage could be killed"
        stages[0].kill()  # rank 1: the error reaches the controller through rank 2
        _, err = proc.communicate(timeout=STOP_TIMEOUT)
        assert proc.returncode == 1, err
        assert "check the logs of the `pdserve stage` ranks" in err and "--resume" in err, err
        assert stages[1].wait(timeout=STOP_TIMEOUT) != 0  # the survivor fails too, it does not hang
        assert 0 < len(_results(out)) < len(PROMPTS)
    finally:
        _stop(proc)
        for s in stages:
            if s.poll() is None:
                s.kill()
            s.wait()


@pytest.mark.parametrize(
    "env,message",
    [
        ({"MASTER_PORT": "1", "WORLD_SIZE": "3"}, "needs MASTER_ADDR"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "3", "RANK": "1"}, "RANK 0"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "1"}, "at least one stage"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "3", "PDSERVE_STAGES": "4"}, "disagrees"),
    ],
)
def test_external_stages_refuses_a_bad_rendezvous_env(tmp_path, monkeypatch, capsys, env, message) -> None:
    from pdserve.cli import main

    (tmp_path / "in.jsonl").write_text(_line("a", "x") + "\n")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "PDSERVE_STAGES"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert main(_cmd(tmp_path, "--external-stages")[3:]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()  # refused before anything is written


def test_batch_refuses_to_overwrite_results_without_resume(tmp_path, capsys) -> None:
    from pdserve.cli import main

    (tmp_path / "in.jsonl").write_text(_line("a", "x") + "\n")
    (tmp_path / "out.jsonl").write_text('{"id": "batch_req_1", "custom_id": "a"}\n')
    assert main(_cmd(tmp_path)[3:]) == 2
    assert "--resume" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_text() == '{"id": "batch_req_1", "custom_id": "a"}\n'


def test_cost_table_choices(tmp_path, capsys) -> None:
    from pdserve.cli import main
    from pdserve.commands.batch_job import table_choice
    from tdpipe.cost_table import CostTable

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
    (tmp_path / "in.jsonl").write_text(_line("a", "x") + "\n")
    assert main(_cmd(tmp_path, "--cost-table", "no-such-table")[3:]) == 2
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
    } <= set(flags)
    assert all(flag in text for flag in flags)
    assert all(a.help for a in parser._actions), [a.option_strings for a in parser._actions if not a.help]
