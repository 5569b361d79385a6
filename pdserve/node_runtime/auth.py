"""Cluster-secret authentication of gRPC calls (metadata `x-pdserve-cluster-secret`).

Shared by the router (client side) and the nodes (server side), so it lives outside both:
the router imports no node-runtime code."""

from __future__ import annotations

import hmac

import grpc

SECRET_METADATA_KEY = "x-pdserve-cluster-secret"
UNAUTHENTICATED_PATHS = ("/grpc.health.v1.Health/",)
"""Kubernetes gRPC probes carry no secret."""


def cluster_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """Metadata a client attaches to every node call."""
    return ((SECRET_METADATA_KEY, secret),) if secret else ()


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls whose metadata lacks the shared secret with UNAUTHENTICATED."""

    def __init__(self, secret: str) -> None:
        self.secret = secret.encode()

    async def intercept_service(self, continuation, handler_call_details):
        if not self.secret or handler_call_details.method.startswith(UNAUTHENTICATED_PATHS):
            return await continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get(SECRET_METADATA_KEY, "")
        if hmac.compare_digest(given.encode(), self.secret):
            return await continuation(handler_call_details)
        return _deny()


def _deny() -> grpc.RpcMethodHandler:
    """A handler that only aborts; gRPC sends the status before any message, so it serves
    unary and streaming methods alike."""

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster secret")

    return grpc.unary_unary_rpc_method_handler(deny)
