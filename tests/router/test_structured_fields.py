"""The structured-output request fields at the router: each spelling becomes one StructuredOutputs
on the wire, and a malformed or invalid spec (or two of them) is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("xgrammar")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SPELLINGS = [
    ({"response_format": {"type": "json_object"}}, ("json_object", "")),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
        ("json_schema", json.dumps(SCHEMA)),
    ),
    ({"structured_outputs": {"json": SCHEMA}}, ("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, ("choice", '["x", "y"]')),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, ("grammar", 'root ::= "x"')),
    ({"structured_outputs": {"json_object": True}}, ("json_object", "")),
    ({"guided_json": json.dumps(SCHEMA)}, ("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "a+"}, ("regex", "a+")),
    ({"guided_choice": ["x"]}, ("choice", '["x"]')),
    ({"guided_grammar": 'root ::= "x"'}, ("grammar", 'root ::= "x"')),
]
BAD = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nosuch"}}}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
]


async def _post(make_client, fields: dict):
    make, _, fake = make_client
    cluster = fake([300, 301])
    async with make(cluster) as client:
        r = await client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 4, **fields})
    return r, cluster


@pytest.mark.parametrize("fields, spec", SPELLINGS, ids=[next(iter(f)) for f, _ in SPELLINGS])
async def test_each_spelling_travels_as_one_structured_outputs(make_client, fields, spec):
    r, cluster = await _post(make_client, fields)
    assert r.status_code == 200, r.text
    sent = cluster.requests[0][1]
    assert sent.HasField("structured_outputs") and (sent.structured_outputs.kind, sent.structured_outputs.spec) == spec


async def test_text_response_format_asks_for_nothing(make_client):
    r, cluster = await _post(make_client, {"response_format": {"type": "text"}})
    assert r.status_code == 200 and not cluster.requests[0][1].HasField("structured_outputs")


@pytest.mark.parametrize("fields, param", BAD, ids=[p for _, p in BAD])
async def test_a_bad_spec_is_a_400_naming_the_field(make_client, fields, param):
    r, _ = await _post(make_client, fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
