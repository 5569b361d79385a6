"""The router's HTTP app: OpenAI-compatible endpoints, auth, bounds, errors in the OpenAI shape."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

import pdserve
from pdserve.openai_api.errors import (
    ModelNotFound,
    NoCapacityError,
    OpenAIError,
    error_body,
    error_response,
    validation_message,
)
from pdserve.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.body_limit import DEFAULT_BODY_TIMEOUT, BodyLimit
from pdserve.router.guard import Guard
from pdserve.router.http_metrics import HttpMetrics
from pdserve.router.key_limits import KeyLimit, KeyLimiter, KeyLimits
from pdserve.router.serving import Server
from pdserve.router.utility_routes import add_utility_routes

MAX_BODY_BYTES = 4 * 1024 * 1024


def create_app(
    server: Server,
    *,
    api_keys: list[str] | None = None,
    registry: CollectorRegistry | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    key_limits: KeyLimits | None = None,
) -> FastAPI:
    """Build the FastAPI app around a Server (which owns the Cluster and tokenizer). `key_limits`:
    per-API-key in-flight and per-minute limits (429), applied after the key is checked."""
    app = FastAPI(
        title="pdserve router",
        version=pdserve.__version__,
        description="OpenAI-compatible API of a disaggregated prefill/decode cluster",
    )
    registry = registry or CollectorRegistry()
    http_metrics = HttpMetrics(registry, server.model_name)
    keys = [k.encode() for k in (api_keys or []) if k]
    # inside Guard, so its 413s and 408s are counted
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes, body_timeout=body_timeout)
    if key_limits is not None and key_limits.any:  # inside Guard: only authenticated keys get state
        key_limits.check_keys(api_keys or [])
        app.add_middleware(KeyLimit, limiter=KeyLimiter(key_limits, registry, server.model_name))

    # added last, so outermost: it counts the inner middlewares' 413s, 408s and 429s too
    app.add_middleware(Guard, keys=keys, metrics=http_metrics, routes=lambda: app.router.routes)

    @app.exception_handler(OpenAIError)
    async def router_error(request: Request, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        # FastAPI's own errors (unknown route, wrong method, an undecodable body) in the OpenAI shape
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    def check_model(name: str) -> None:
        if name not in server.model_names:
            served = ", ".join(repr(n) for n in server.model_names)
            raise ModelNotFound(f"the model {name!r} does not exist; this server serves {served}", "model")

    @app.get("/v1/models")
    async def models() -> dict:
        """Every served name (vLLM's shape; root: the first name, the one model they all serve); sampling_defaults
        are the generation_config.json values applied to requests that leave the field unset."""
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "pdserve",
                    "root": server.model_name,
                    "parent": None,
                    "max_model_len": server.max_model_len,
                    "sampling_defaults": server.generation_defaults,
                }
                for name in server.model_names
            ],
        }

    async def generate(body: CompletionRequest | ChatCompletionRequest):
        """Both generation endpoints: an SSE stream when the body asks for one, else the whole response."""
        check_model(body.model)
        chat = isinstance(body, ChatCompletionRequest)
        if body.stream:
            return _sse(await server.stream(body, chat=chat))
        return await server.chat(body) if isinstance(body, ChatCompletionRequest) else await server.completion(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await generate(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await generate(body)

    @app.get("/health")
    async def health():
        if not server.cluster.is_healthy():
            raise NoCapacityError("no healthy decode node yet")
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        return {"version": pdserve.__version__}

    add_utility_routes(app, server, check_model)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/cluster", include_in_schema=False)
    async def cluster_state() -> dict:
        return {"nodes": server.cluster.snapshot()}

    return app


def _sse(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


__all__ = ["create_app"]
