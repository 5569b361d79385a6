"""Structured outputs over HTTP on a real cluster (router app + in-process prefill and decode nodes,
the built-in tiny model): every constrained output is valid, while free text from the same prompts
is almost never JSON; regex and choice hold; no block leaks (tests/router/test_structured_fields.py: the 400s).

Every prompt is prefilled on the prefill node (local_max=0), so each first token is sampled there
under the grammar and replayed into the decode node's matcher."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.node_runtime.discovery.static import StaticDiscovery
from pdserve.router.app import create_app
from pdserve.router.cluster import Cluster
from pdserve.router.serving import Server
from tests.e2e.inproc import SECRET, Nodes, assert_no_blocks_used, in_process_nodes
from tests.e2e.structured_cases import PROMPTS, SCHEMAS, is_valid

pytestmark = pytest.mark.e2e
pytest.importorskip("xgrammar")
N = 2  # choices per request: the router fans them out to the decode node concurrently


@contextlib.asynccontextmanager
async def http_cluster(model_dir) -> AsyncIterator[tuple[httpx.AsyncClient, Nodes]]:
    async with in_process_nodes(model_dir, local_max=0) as nodes:
        discovery = StaticDiscovery.from_lists(",".join(nodes.prefill_addresses), nodes.decode_address)
        cluster = Cluster(discovery, cluster_secret=SECRET, refresh_interval=0.05)
        await cluster.start()
        try:
            deadline = time.monotonic() + 30
            while not cluster.is_healthy():
                assert time.monotonic() < deadline, "the router never saw healthy nodes"
                await asyncio.sleep(0.05)
            app = create_app(Server(cluster, Tokenizer(model_dir), "m", 4096))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=120) as client:
                yield client, nodes
        finally:
            await cluster.stop()


def _body(prompt: str, **fields) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 160, "temperature": 1.0, "n": N, **fields}


async def _texts(client: httpx.AsyncClient, path: str, body: dict) -> list[tuple[str, str]]:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return [(c["text"] if "text" in c else c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]]


async def test_every_constrained_output_matches_its_schema_and_free_text_does_not(tiny_model_dir):
    async with http_cluster(tiny_model_dir) as (client, nodes):
        outputs, free = [], []
        for i, (name, schema) in enumerate(SCHEMAS.items()):
            prompt = PROMPTS[i % len(PROMPTS)]
            # the three spellings, across both endpoints
            spelled = [
                {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}},
                {"structured_outputs": {"json": schema}},
                {"guided_json": json.dumps(schema)},
            ][i % 3]
            if i % 2:
                body = {"messages": [{"role": "user", "content": prompt}], **_body(prompt, seed=i, **spelled)}
                del body["prompt"]
                got = await _texts(client, "/v1/chat/completions", body)
            else:
                got = await _texts(client, "/v1/completions", _body(prompt, seed=i, **spelled))
            outputs += [(name, text, reason) for text, reason in got]
            control = _body(prompt, seed=i, max_tokens=24)  # enough tokens to show free text is not JSON
            free += [(name, text) for text, _ in await _texts(client, "/v1/completions", control)]
        strict = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"], "strict": True}}
        got = await _texts(client, "/v1/completions", _body("Water is", response_format=strict))
        outputs += [("person", text, reason) for text, reason in got]
        bad = [(name, text, reason) for name, text, reason in outputs if not is_valid(text, SCHEMAS[name])]
        assert not bad and all(reason == "stop" for _, _, reason in outputs), bad
        assert sum(is_valid(text, SCHEMAS[name]) for name, text in free) <= 1, free  # the control
        # JSON without free whitespace: the separators are the only spaces outside strings
        assert all("\n" not in text and "  " not in text for _, text, _ in outputs)
        await assert_no_blocks_used(nodes)


async def test_regex_choice_and_json_object(tiny_model_dir):
    async with http_cluster(tiny_model_dir) as (client, nodes):
        got = await _texts(
            client, "/v1/completions", _body("Code:", structured_outputs={"regex": "[0-9]{3}-[a-z]{2,4}"})
        )
        assert all(re.fullmatch("[0-9]{3}-[a-z]{2,4}", t) and why == "stop" for t, why in got), got
        choices = ["yes", "no", "maybe so"]
        got = await _texts(client, "/v1/completions", _body("Answer:", guided_choice=choices, temperature=0.0))
        assert all(t in choices and why == "stop" for t, why in got), got
        got = await _texts(client, "/v1/completions", _body("JSON:", response_format={"type": "json_object"}))
        for text, why in got:  # any object: a random model may run out of tokens inside a long key
            assert why == "length" or isinstance(json.loads(text), dict), text
        plain = await _texts(client, "/v1/completions", _body("JSON:", response_format={"type": "text"}, n=1))
        assert len(plain) == 1
        await assert_no_blocks_used(nodes)
