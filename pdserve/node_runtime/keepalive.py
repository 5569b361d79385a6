"""gRPC keepalive: a peer that stops answering fails the calls on its channel within `peer_timeout`.

A partitioned or frozen host sends no FIN and no RST, so without pings a call to it only ends at
its own deadline (a prefill call's is `--kv-timeout`, 60 s by default). With HTTP/2 pings every
PING_INTERVAL_MS, the transport is declared dead when a ping goes unanswered for `peer_timeout`
seconds and every call on it fails UNAVAILABLE, which the callers already retry elsewhere.

Both ends need options: the client pings, and the server must accept pings more often than its
default (one per 5 minutes, then GOAWAY "too_many_pings"). The server also pings its clients, so a
prefill node stops a transfer whose decode node vanished instead of waiting on it.
"""

from __future__ import annotations

PING_INTERVAL_MS = 1000
"""How often a channel with calls in flight pings its peer: small next to any peer_timeout."""
DEFAULT_PEER_TIMEOUT = 10.0
"""Seconds without a ping answer before a peer is dead: the router's default --hung-after."""


def _timeout_ms(peer_timeout: float) -> int:
    if peer_timeout <= 0:
        raise ValueError(f"peer_timeout must be > 0, got {peer_timeout}")
    return max(1, int(peer_timeout * 1000))


def client_options(peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> list[tuple[str, int]]:
    """Channel options: ping while calls are in flight; fail them when the peer stops answering."""
    return [
        ("grpc.keepalive_time_ms", PING_INTERVAL_MS),
        ("grpc.keepalive_timeout_ms", _timeout_ms(peer_timeout)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),  # a long prefill sends no data: keep pinging anyway
        # a connection attempt to an unreachable peer gets no answer either: give up on it as soon
        # (gRPC's default is 20 s), so a call to it fails and the caller tries another node
        ("grpc.min_reconnect_backoff_ms", _timeout_ms(peer_timeout)),
    ]


def server_options(peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> list[tuple[str, int]]:
    """Server options: accept the clients' pings, and ping clients to drop calls of a vanished one."""
    return [
        ("grpc.keepalive_time_ms", PING_INTERVAL_MS),
        ("grpc.keepalive_timeout_ms", _timeout_ms(peer_timeout)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", PING_INTERVAL_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),  # 0: never GOAWAY a client for pinging
        ("grpc.http2.max_pings_without_data", 0),
    ]
