"""Per-API-key limits (router/key_limits.py): a key over its in-flight or per-minute limit gets a
429 with Retry-After before any work, other keys are unaffected, a stream counts until it ends, and
limits without keys are refused at start."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pdserve.cli import build_parser
from pdserve.commands.router import router_config
from pdserve.openai_api.errors import RateLimited
from pdserve.router.key_limits import KeyLimiter, KeyLimits
from tests.router.paced import PacedCluster

BODY = {"model": "m", "prompt": "hi", "max_tokens": 3}


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_the_bucket_allows_a_burst_of_rpm_then_refills_at_the_rate():
    limiter = KeyLimiter(KeyLimits(api_key_rpm=3), CollectorRegistry(), "m")
    for _ in range(3):
        limiter.release(limiter.acquire(b"a", now=0.0))
    with pytest.raises(RateLimited) as refused:
        limiter.acquire(b"a", now=0.0)
    assert refused.value.status == 429 and refused.value.retry_after == pytest.approx(20.0)
    limiter.acquire(b"b", now=0.0)  # another key has its own bucket
    limiter.acquire(b"a", now=20.0)  # one request's worth refilled after 60 / 3 s
    with pytest.raises(RateLimited):
        limiter.acquire(b"a", now=20.0)


def test_negative_limits_and_limits_without_keys_are_refused_by_name():
    with pytest.raises(ValueError, match="--api-key-rpm must be >= 0"):
        KeyLimits(api_key_rpm=-1)
    with pytest.raises(ValueError, match="--api-key-max-in-flight limits each API key, but no key"):
        KeyLimits(api_key_max_in_flight=2).check_keys(())
    KeyLimits().check_keys(())  # no limits: keys optional


def test_router_flags_build_the_limits(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    args = build_parser().parse_args(
        ["router", "--api-key-file", str(keys), "--api-key-max-in-flight", "2", "--api-key-rpm", "60"]
    )
    assert router_config(args).key_limits == KeyLimits(api_key_max_in_flight=2, api_key_rpm=60)
    with pytest.raises(SystemExit, match="--api-key-rpm limits each API key"):
        router_config(build_parser().parse_args(["router", "--api-key-rpm", "60"]))


async def test_a_key_over_its_in_flight_limit_gets_429_while_its_stream_runs(make_client):
    make, _, _ = make_client
    cluster = PacedCluster([5, 6, 7], pace=0.3)
    registry = CollectorRegistry()
    limits = KeyLimits(api_key_max_in_flight=1)
    async with make(cluster, api_keys=["k1", "k2"], key_limits=limits, registry=registry) as client:
        stream = asyncio.create_task(client.post("/v1/completions", json={**BODY, "stream": True}, headers=_auth("k1")))
        await asyncio.sleep(0.2)  # its stream has started and runs for about a second
        refused = await client.post("/v1/completions", json=BODY, headers=_auth("k1"))
        other = await client.post("/v1/completions", json=BODY, headers=_auth("k2"))
        assert (await stream).status_code == 200
        after = await client.post("/v1/completions", json=BODY, headers=_auth("k1"))
        wrong = await client.post("/v1/completions", json=BODY, headers=_auth("nope"))
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert other.status_code == 200 and after.status_code == 200
    assert wrong.status_code == 401  # the key check comes first: an unknown key gets no state
    sample = registry.get_sample_value("pdserve_router_rate_limited_total", {"model_name": "m", "limit": "in_flight"})
    assert sample == 1.0


async def test_a_key_over_its_rpm_gets_429_before_its_body_is_read(make_client):
    make, _, fake = make_client
    cluster = fake([1, 2, 3])
    async with make(cluster, api_keys=["k1"], key_limits=KeyLimits(api_key_rpm=2)) as client:
        codes = [(await client.post("/v1/completions", json=BODY, headers=_auth("k1"))) for _ in range(3)]
        models = await client.get("/v1/models", headers=_auth("k1"))
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert int(codes[2].headers["retry-after"]) == 30
    assert len(cluster.requests) == 2  # the refused one reached no node
    assert models.status_code == 200  # reads are not counted


async def test_only_the_checked_key_is_counted_when_a_request_repeats_the_header():
    """The API-key guard checks the first Authorization header; a second one (any string a client
    makes up) must not get its own bucket, or the limiter's memory would grow without bound."""
    from pdserve.router.key_limits import KeyLimit

    limiter = KeyLimiter(KeyLimits(api_key_rpm=10), CollectorRegistry(), "m")

    async def app(scope, receive, send) -> None:
        pass

    for i in range(3):
        headers = [(b"authorization", b"Bearer k1"), (b"authorization", f"Bearer made-up-{i}".encode())]
        await KeyLimit(app, limiter)(
            {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, None, None
        )
    assert list(limiter._keys) == [b"k1"]
