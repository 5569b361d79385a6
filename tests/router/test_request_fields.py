"""Every row of the request-field table (docs/request-fields.md), sent to the app: honoured fields get a 200,
refused ones a 400 naming the field; and the table covers every field the code knows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pdserve.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.openai_api.request_fields import REFUSED
from tests.router.conftest import FakeCluster

TABLE_DOC = Path(__file__).resolve().parents[2] / "docs" / "request-fields.md"
ROW = re.compile(
    r"^\| (`?)(?P<field>[^|`]+)\1(?P<suffix>[^|]*)\| (?P<ends>\w+) \| (?P<status>\w+) \| `?(?P<ex>.*?)`? \|"
)


def table() -> list[tuple[str, str, str, str]]:
    text = TABLE_DOC.read_text()
    body = text[text.index("<!-- request-fields -->") : text.index("<!-- /request-fields -->")]
    rows = []
    for line in body.splitlines()[3:]:
        m = ROW.match(line)
        assert m, line
        name = (m["field"] + m["suffix"]).strip()
        for endpoint in ("completions", "chat") if m["ends"] == "both" else (m["ends"],):
            rows.append((name, endpoint, m["status"], m["ex"]))
    return rows


ROWS = table()
BASE = {
    "completions": ("/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 4}),
    "chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
}


def body_for(name: str, endpoint: str, example: str) -> tuple[str, dict, str]:
    """(path, body, expected param) for one table row."""
    path, base = BASE[endpoint]
    body = dict(base)
    if name == "any other field":
        body[example] = 4
        return path, body, example
    if name.startswith("messages[]."):
        key = name.split(".", 1)[1].split()[0]
        body["messages"] = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "Hi"}]
        body["messages"][0][key] = json.loads(example)
        return path, body, f"messages[0].{key}"
    value = json.loads(example)
    body[name] = value
    if name in ("stream_options",):
        body["stream"] = True
    if name == "top_logprobs":
        body["logprobs"] = True
    if name == "model":
        body[name] = "m"  # the fake app serves "m"
    return path, body, name


@pytest.mark.parametrize("name, endpoint, status, example", ROWS, ids=[f"{r[0]}-{r[1]}" for r in ROWS])
async def test_every_row_of_the_readme_table(make_client, name, endpoint, status, example):
    make, _, _ = make_client
    path, body, param = body_for(name, endpoint, example)
    async with make(FakeCluster(list(range(300, 310)))) as client:
        r = await client.post(path, json=body)
    if status == "honoured":
        assert r.status_code == 200, r.text
    else:
        assert status == "refused"
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and param.split("[")[0] in r.json()["error"]["message"]


@pytest.mark.parametrize("name", sorted(REFUSED))
async def test_a_refused_field_that_asks_for_nothing_is_accepted(make_client, name):
    make, _, _ = make_client
    endpoint = "chat" if "chat" in REFUSED[name].endpoints else "completions"
    path, base = BASE[endpoint]
    async with make(FakeCluster([300, 301])) as client:
        r = await client.post(path, json={**base, name: None})
    assert r.status_code == 200, r.text


def test_the_table_names_every_field_the_code_knows():
    in_table = {name for name, *_ in ROWS}
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert declared | set(REFUSED) <= in_table, (declared | set(REFUSED)) - in_table


async def test_honoured_fields_reach_the_node(make_client):
    make, tok, _ = make_client
    cluster = FakeCluster([300, 301])
    async with make(cluster) as client:
        body = {"model": "m", "prompt": "Hi", "max_tokens": 2, "stop_token_ids": [2, 3]}
        body |= {"include_stop_str_in_output": True, "skip_special_tokens": False, "logit_bias": {"5": -100, "7": 2.5}}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        bad = await client.post("/v1/completions", json={**body, "logit_bias": {str(tok.vocab_size): 1}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
    _, params = cluster.requests[0]
    assert list(params.stop_token_ids) == [2, 3] and params.include_stop_str_in_output
    assert params.HasField("skip_special_tokens") and not params.skip_special_tokens
    assert dict(params.logit_bias) == {5: -100.0, 7: 2.5}


async def test_include_stop_str_in_output_keeps_the_stop_string(make_client):
    make, tok, _ = make_client
    ids = tok.encode("one. two", add_special_tokens=False)
    for include, expected in ((False, "one"), (True, "one.")):
        async with make(FakeCluster(ids)) as client:
            body = {"model": "m", "prompt": "Hi", "max_tokens": len(ids), "stop": ["."]}
            r = await client.post("/v1/completions", json={**body, "include_stop_str_in_output": include})
        assert r.json()["choices"][0]["text"].strip() == expected
