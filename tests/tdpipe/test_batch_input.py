"""The batch job's input and output side without a pipeline: poison lines each become exactly one
error line (under their custom_id when it can be recovered), the output lock, `--resume` over a
torn line, the input-order writer and its bound, and the policies fed through a RequestFeed."""

from __future__ import annotations

import io
import json
import os
import random

import pytest

from tests.tdpipe.batch_helpers import request_line

WINDOW = 40


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from pdserve.engine.tokenizer import Tokenizer

    return Tokenizer(str(tiny_model_dir))


def _run_lines(data: bytes, tok, **kw) -> tuple[list[str], list[dict]]:
    """Pull every line of `data` through a LineSource; (ids that would run, output lines)."""
    from pdserve.openai_api.choices import ChoiceBuilder
    from pdserve.tdpipe.runtime.batch_input import read_lines
    from pdserve.tdpipe.runtime.batch_output import OrderedWriter
    from pdserve.tdpipe.runtime.batch_stream import LineSource

    out = io.BytesIO()
    writer = OrderedWriter(out, "completion")
    src = LineSource(
        read_lines(io.BytesIO(data), **kw),
        ChoiceBuilder(tok, lambda: 4096),
        tok,
        "pdserve-tiny",
        writer,
        set(),
        window=1000,
        capacity=4096,
    )
    todo = []
    while (req := src.pull()) is not None:
        todo.append(str(req.request_id))
    return todo, [json.loads(x) for x in out.getvalue().split(b"\n") if x]


def _code(row: dict) -> str:
    return row["error"]["code"] if row["error"] else row["response"]["body"]["error"]["code"]


def test_each_poison_line_is_one_error_line_under_its_custom_id(tok) -> None:
    deep = '{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": {"prompt": %s}}' % (
        "[" * 10_000 + "]" * 10_000
    )
    rng = random.Random(0)
    binary = bytes(rng.choice([b for b in range(256) if b != 10]) for _ in range(2000))
    lines = [
        b"\xef\xbb\xbf" + request_line("bom", "after a byte order mark").encode(),
        deep.encode(),
        request_line("seps", "a\u2028b\u2029c\u0085d", max_tokens=2).replace("\\u2028", "\u2028").encode(),
        request_line("utf8", "x").encode().replace(b'"x"', b'"\xff\xfe"'),
        binary,
        b'{"custom_id": "bin", ' + binary[:500],  # garbage after a readable custom_id
        request_line("other", "x", model="gpt-4"),
        json.dumps(
            {
                "custom_id": "tools",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            }
        ),
        request_line("big", "y" * 30_000),
    ]
    lines = [ln if isinstance(ln, bytes) else ln.encode() for ln in lines]
    assert "\u2028".encode() in lines[2] and b"\n" not in binary
    todo, rows = _run_lines(b"\n".join(lines) + b"\n", tok, max_line_bytes=len(lines[-1]) - 1)
    assert todo == ["bom", "seps"]  # both run: a BOM and raw separators inside a string are valid
    got = {(r["custom_id"], _code(r)) for r in rows}
    assert len(rows) == len(lines) - 2  # exactly one error line per bad input line
    assert got == {
        ("deep", "invalid_json"),  # RecursionError, not ValueError: still one line, id recovered by scan
        ("utf8", "invalid_encoding"),
        (None, "invalid_encoding"),  # the binary line: no id to recover
        ("bin", "invalid_encoding"),
        ("other", "model_not_found"),
        ("tools", "invalid_body"),  # refused as the router refuses it (openai_api.request_fields)
        ("big", "line_too_long"),
    }
    by_id = {r["custom_id"]: r for r in rows}
    assert by_id["other"]["response"]["status_code"] == 404
    assert by_id["tools"]["response"]["status_code"] == 400
    assert "tools" in by_id["tools"]["response"]["body"]["error"]["message"]
    assert by_id["deep"]["error"]["line"] == 2 and by_id["big"]["error"]["line"] == 9


def test_a_deep_body_that_parses_is_refused_not_raised(tok) -> None:
    """A nesting the JSON parser survives may still blow up a validator: the line is refused."""
    import sys

    depth = sys.getrecursionlimit() - 100
    line = request_line("d", "x").replace('"x"', "[" * depth + "]" * depth)
    todo, rows = _run_lines(line.encode(), tok)
    assert todo == [] and [r["custom_id"] for r in rows] == ["d"]


def test_second_job_on_one_output_fails_at_once(tmp_path) -> None:
    from pdserve.tdpipe.runtime.batch_output import open_output

    path = str(tmp_path / "out.jsonl")
    first, _ = open_output(path, resume=False)
    with pytest.raises(ValueError, match="another `pdserve batch` job"):
        open_output(path, resume=True)
    first.close()
    again, _ = open_output(path, resume=True)  # the lock went with the first job
    again.close()


def test_resume_keeps_every_valid_line_around_a_torn_one(tmp_path) -> None:
    from pdserve.tdpipe.runtime.batch_output import open_output

    def row(cid: str) -> str:
        return json.dumps({"id": "x", "custom_id": cid, "response": {"status_code": 200}, "error": None})

    path = tmp_path / "out.jsonl"
    path.write_text(
        row("a") + "\n" + '{"id": "x", "custom_id": "b", "resp' + "\n" + row("c") + "\n\x00\x01garbage\n" + row("d")
    )
    f, done = open_output(str(path), resume=True)
    f.write(b"appended\n")
    f.close()
    assert done == {("id", "a"), ("id", "c"), ("id", "d")}
    assert path.read_text() == "\n".join([row("a"), row("c"), row("d"), "appended"]) + "\n"
    assert not os.path.exists(f"{path}.resume-tmp")


def test_ordered_writer_holds_early_finishers_until_their_turn() -> None:
    from pdserve.tdpipe.runtime.batch_output import OrderedWriter

    out = io.BytesIO()
    w = OrderedWriter(out)
    tickets = [w.ticket() for _ in range(4)]
    for t in (2, 1, 3):
        w.put(tickets[t], {"n": t})
    assert out.getvalue() == b"" and w.held == 3 and w.in_flight == 4
    w.put(tickets[0], {"n": 0})
    assert [json.loads(x)["n"] for x in out.getvalue().splitlines()] == [0, 1, 2, 3] and w.in_flight == 0


@pytest.mark.parametrize("policy", ["tdpipe", "pp-sb", "pp-hb"])
@pytest.mark.parametrize("max_out", [40, 1])
@pytest.mark.parametrize("read_ahead", [False, True])
def test_policies_run_a_feed_with_a_bounded_window(policy, max_out, read_ahead) -> None:
    """The simulator's policies drain a RequestFeed whose source stops at WINDOW unfinished requests,
    and every request completes (a full window never stalls them; nor do prefill phases whose
    requests all finish at their prefill, which TD-Pipe once took for requests that cannot fit).
    `read_ahead`: the feed was read before the policy took it, as `pdserve batch` does; PP's
    virtual engines once drew only from the source behind it, so those requests never ran and the
    job ended at once, every line unanswered and no error."""
    from pdserve.tdpipe.config import InstanceConfig
    from pdserve.tdpipe.cost_table import CostTable
    from pdserve.tdpipe.executor import SimExecutor
    from pdserve.tdpipe.feed import RequestFeed
    from pdserve.tdpipe.simulator import make_policy
    from pdserve.tdpipe.workload import SimRequest

    rng = random.Random(1)
    todo = [SimRequest(i, rng.randint(4, 60), rng.randint(1, max_out), 20) for i in range(300)]
    expected = sum(r.output_len for r in todo)
    source, open_, peak = iter(todo), [0], [0]

    class Counting(SimExecutor):
        def finish(self, request: SimRequest) -> None:
            super().finish(request)
            open_[0] -= 1

    def pull() -> SimRequest | None:
        if open_[0] >= WINDOW:
            return None
        r = next(source, None)
        if r is not None:
            open_[0] += 1
            peak[0] = max(peak[0], open_[0])
        return r

    inst = InstanceConfig(num_stages=2, capacity_blocks=64, block_size=4, max_batch_tokens=128)
    table = CostTable.analytic()
    feed = RequestFeed(pull, WINDOW)
    if read_ahead:
        assert feed  # as `pdserve batch` does before the policy runs: the feed now holds a window
    stats = make_policy(policy, table, inst).run(feed, Counting(table, 2))
    assert stats.output_tokens == expected and open_[0] == 0 and 0 < peak[0] <= WINDOW


def test_completion_order_writes_at_once() -> None:
    from pdserve.tdpipe.runtime.batch_output import OrderedWriter

    out = io.BytesIO()
    w = OrderedWriter(out, "completion")
    first, second = w.ticket(), w.ticket()
    w.put(second, {"n": 1})
    assert json.loads(out.getvalue()) == {"n": 1} and w.in_flight == 1
    w.put(first, {"n": 0})
    assert w.in_flight == 0 and w.held == 0
    with pytest.raises(ValueError, match="input or completion"):
        OrderedWriter(out, "random")
