"""The router's vLLM utility endpoints beside the OpenAI ones: /tokenize, /detokenize and /ping.

A vLLM client or load balancer calls these on any vLLM server; they answer from the router's own
tokenizer and health, without a node. Like vLLM, they sit outside /v1, so API keys do not guard them
(they reveal only the tokenizer, which the served model's checkpoint already publishes).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import FastAPI
from fastapi.responses import Response

from pdserve.openai_api.errors import NoCapacityError
from pdserve.openai_api.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from pdserve.router.serving import Server


def add_utility_routes(app: FastAPI, server: Server, check_model: Callable[[str], None]) -> None:
    """Register /tokenize, /detokenize and /ping (GET and POST, as vLLM; SageMaker probes POST)."""

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict:
        if body.model is not None:
            check_model(body.model)
        # a long prompt tokenizes without holding the event loop (Tokenizer releases the GIL)
        return await asyncio.to_thread(tokenize, server.tokenizer, body, server.max_model_len)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            check_model(body.model)
        return await asyncio.to_thread(detokenize, server.tokenizer, body)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        if not server.cluster.is_healthy():
            raise NoCapacityError("no healthy decode node yet")
        return Response(status_code=200)
