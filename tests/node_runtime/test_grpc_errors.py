"""The one exception -> gRPC status mapping of the node servicers (`pdserve.node_runtime.grpc_errors`)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.cachestore import SessionError, TransferError
from pdserve.engine.request import AdmissionError
from pdserve.node_runtime.engine_loop import EngineDeadError
from pdserve.node_runtime.grpc_errors import (
    ErrorInterceptor,
    IncompatiblePeer,
    NodeUnavailable,
    RequestAborted,
    status_of,
)


@pytest.mark.parametrize(
    "error, code",
    [
        (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (AdmissionError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (IncompatiblePeer("other model"), grpc.StatusCode.FAILED_PRECONDITION),
        (TransferError("lost"), grpc.StatusCode.UNAVAILABLE),
        (SessionError("expired"), grpc.StatusCode.UNAVAILABLE),
        (NodeUnavailable("draining"), grpc.StatusCode.UNAVAILABLE),
        (EngineDeadError("dead"), grpc.StatusCode.UNAVAILABLE),
        (RequestAborted("aborted"), grpc.StatusCode.ABORTED),
    ],
)
def test_each_exception_has_its_code_and_keeps_its_message(error, code):
    assert status_of(error) == (code, str(error))


def test_an_unexpected_exception_is_not_mapped():
    assert status_of(RuntimeError("bug")) is None
    assert status_of(KeyError("bug")) is None


class FakeContext:
    """Records the abort a handler makes (grpc.aio's context raises AbortError the same way)."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise grpc.aio.AbortError()


async def _handler(behavior, streaming: bool):
    handler = (grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler)(behavior)

    async def continuation(_):
        return handler

    return await ErrorInterceptor().intercept_service(continuation, None)


async def test_unary_and_stream_handlers_abort_with_the_mapped_code():
    async def unary(request, context):
        raise AdmissionError("no KV room")

    async def stream(request, context):
        yield 1
        raise ValueError("bad stop string")

    context = FakeContext()
    with pytest.raises(grpc.aio.AbortError):
        await (await _handler(unary, False)).unary_unary(None, context)
    assert context.status == (grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV room")

    context, events = FakeContext(), []
    with pytest.raises(grpc.aio.AbortError):
        async for event in (await _handler(stream, True)).unary_stream(None, context):
            events.append(event)
    assert events == [1] and context.status == (grpc.StatusCode.INVALID_ARGUMENT, "bad stop string")


async def test_a_stream_closed_early_runs_the_servicer_cleanup_at_once():
    cleaned = []

    async def stream(request, context):
        try:
            yield 1
            yield 2
        finally:
            cleaned.append(True)

    events = (await _handler(stream, True)).unary_stream(None, FakeContext())
    assert await events.__anext__() == 1
    await events.aclose()  # what a cancelled call does to the outer generator
    assert cleaned == [True]
