"""One place that turns a node servicer's exceptions into gRPC status codes.

Servicers raise plain exceptions (a `ValueError` for a bad request, `AdmissionError` when there is
no KV room, ...) and `ErrorInterceptor` aborts the call with the matching code, so no handler
writes `context.abort` by hand and every method maps the same exception the same way (TGI does the
same with one interceptor).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Awaitable, Callable

import grpc

from pdserve.cachestore import SessionError, TransferError
from pdserve.engine.request import AdmissionError
from pdserve.node_runtime.engine_loop import EngineDeadError

log = logging.getLogger("pdserve.grpc")


class IncompatiblePeer(Exception):
    """The peer node runs another model, dtype, block size or layout: their KV cannot be exchanged."""


class NodeUnavailable(Exception):
    """This node cannot serve the request now (draining, or every prefill node failed): try another."""


class TooManySubscribers(Exception):
    """The node already serves its maximum of KvEvents streams (RESOURCE_EXHAUSTED)."""


class RequestAborted(Exception):
    """The engine aborted the request before it produced its result."""


STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (AdmissionError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TooManySubscribers, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (IncompatiblePeer, grpc.StatusCode.FAILED_PRECONDITION),
    (TransferError, grpc.StatusCode.UNAVAILABLE),
    (SessionError, grpc.StatusCode.UNAVAILABLE),
    (NodeUnavailable, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),  # the node is gone: the router counts it against the node
    (RequestAborted, grpc.StatusCode.ABORTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # last: the exceptions above are the more specific ones
)
"""Exception -> status code, first match wins. Anything else stays UNKNOWN (a bug, logged by gRPC)."""


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a servicer exception maps to, or None for an unexpected one.

    A peer's refusal (`AioRpcError` a servicer lets through) keeps the peer's code: the decode
    node passes a prefill node's INVALID_ARGUMENT / FAILED_PRECONDITION on to its own caller."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or error.code().name.lower().replace("_", " ")
    for kind, code in STATUS_CODES:
        if isinstance(error, kind):
            return code, str(error)
    return None


async def _abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    status = status_of(error)
    if status is None:
        raise error
    await context.abort(*status)


def _unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise  # already a status
        except Exception as e:
            await _abort_with(context, e)

    return handle


def _stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            # aclosing: a cancelled stream closes the servicer's generator now (running its
            # cleanup at once), not whenever the garbage collector finalizes it
            async with contextlib.aclosing(behavior(request, context)) as events:
                async for event in events:
                    yield event
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort_with(context, e)

    return handle


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary-unary and (generator) unary-stream method with the `STATUS_CODES` mapping."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_unary(handler.unary_unary))
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return handler._replace(unary_stream=_stream(handler.unary_stream))
        return handler  # e.g. health's Watch, which writes through the context itself
