"""The router's HTTP app against a fake cluster (no node processes)."""

from __future__ import annotations

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, decode_pb2
from pdserve.router.app import create_app
from pdserve.openai_api.errors import NoCapacityError, UpstreamError
from pdserve.router.serving import Server


class FakeCluster:
    """Yields a fixed token script; optionally fails after some chunks, or raises `crash` (a bug) at once."""

    def __init__(
        self, tokens: list[int], fail_after: int | None = None, healthy: bool = True, crash: Exception | None = None
    ) -> None:
        self.tokens = tokens
        self.fail_after = fail_after
        self.healthy = healthy
        self.crash = crash
        self.requests: list[tuple[list[int], common_pb2.SamplingParams]] = []
        self.salts: list[str | None] = []
        self.request_ids: list[str] = []
        self.cached_tokens = 0  # reported as the node's Usage.cached_tokens

    def is_healthy(self) -> bool:
        return self.healthy

    def max_model_len(self) -> int:
        return 128

    def check_admission(self) -> None:
        """Never full: the admission queue has its own tests (tests/router/test_admission.py)."""

    def snapshot(self) -> list:
        return []

    async def admit(self, request):
        """The real Cluster.admit's refusal (before any response) when no node is healthy; the route
        is opaque to the Server."""
        if not self.healthy:
            raise NoCapacityError("no healthy prefill and decode node is available", retry_after=1.0)
        return None

    async def generate(self, request, route=None):
        if not self.healthy:
            raise NoCapacityError("no healthy prefill and decode node is available")
        if self.crash is not None:
            raise self.crash
        prompt, params = list(request.prompt_token_ids), request.params
        self.requests.append((prompt, params))
        self.request_ids.append(request.request_id)
        self.salts.append(request.cache_salt if request.HasField("cache_salt") else None)
        n = min(len(self.tokens), params.max_tokens)
        for i, t in enumerate(self.tokens[:n]):
            if self.fail_after is not None and i == self.fail_after:
                raise UpstreamError("decode node vanished")
            last = i == n - 1
            usage = common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=n, cached_tokens=self.cached_tokens)
            yield decode_pb2.GenerateEvent(
                token_ids=[t], finish_reason="length" if last else "", usage=usage if last else None
            )


@pytest.fixture
def make_client(tiny_model_dir):
    """(make(cluster, **create_app_kwargs) -> AsyncClient, tokenizer, FakeCluster)"""
    tok = Tokenizer(tiny_model_dir)

    def make(cluster: FakeCluster, **kwargs) -> httpx.AsyncClient:
        app = create_app(Server(cluster, tok, "m", 128), **kwargs)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")

    return make, tok, FakeCluster
