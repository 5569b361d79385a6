"""Connection limits of the router's HTTP server: no idle or slow-header socket may hold a file
descriptor for long, and the number of open connections stays below the process's fd limit.

uvicorn on its own closes nothing before a first request (an idle socket stays open forever), lets
one byte of a header reset its keep-alive timer, and accepts until accept() fails with EMFILE, at
which point every new client is refused. Here:

- a connection must deliver a complete request head within `header_timeout` of opening, or of its
  previous response plus `keepalive_timeout`; otherwise it is closed (idle sockets, header drippers);
- at most `max_connections` are open: a new connection beyond it closes the connection idle the
  longest (no request in progress), so a flood of idle sockets cannot lock out real clients; when
  every connection has a request in progress, the new one gets a 503 in the OpenAI error shape;
- the whole body must arrive within `body_timeout` of the request head (enforced where the body is
  read, router.body_limit: a 408 in the OpenAI error shape), so a body drip holds no connection long.
"""

from __future__ import annotations

import json
import logging
import resource
from dataclasses import dataclass, replace

from pdserve.openai_api.errors import error_body
from pdserve.router.http_protocol import OpenAIErrorH11Protocol

log = logging.getLogger("pdserve.router")
FD_RESERVE = 256
"""File descriptors kept for everything but client connections (node channels, logs, model files)
and for connections accepted in one burst before the excess is closed."""


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-process limits on client connections (seconds, counts)."""

    header_timeout: float = 10.0
    """Close a connection whose request head is not complete this long after it opened."""
    keepalive_timeout: float = 75.0
    """Close an idle keep-alive connection this long after its last response. Longer than the common
    clients' own idle limits (httpx, and so the openai package, 5 s; aiohttp 15 s), as nginx's 75 s
    is: a server that closes first races a client that reuses the connection as it closes, and the
    request is lost (`ClientOSError ... Can not write request body`; AIPerf, which pools for 300 s,
    lost one of ~1,500 requests so at 5 s, uvicorn's default). Idle connections cost little here: past
    --max-connections the idlest one is closed."""
    max_connections: int = 4096
    """Open client connections at most (lowered to fit the open-file limit; beyond it the idlest
    connection is closed, or a 503 when all are busy)."""
    body_timeout: float = 60.0
    """Answer 408 and close when a request's whole body has not arrived this long after its head (a
    slow-body drip; 60 s is the 4 MiB body cap at 70 KB/s)."""

    def __post_init__(self) -> None:
        for name in ("header_timeout", "keepalive_timeout", "body_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")

    def for_fd_limit(self, nofile: int) -> "ConnectionLimits":
        """These limits with max_connections lowered to fit `nofile` descriptors."""
        cap = max(1, min(self.max_connections, nofile - FD_RESERVE))
        return replace(self, max_connections=cap)


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (a service default of 1,024 is easy to exhaust);
    the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # e.g. a container that caps it below the hard value
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


_REFUSAL = json.dumps(
    error_body("too many open connections to this server; try again later", "server_error", None, "overloaded")
).encode()
REFUSAL_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    + b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n" % len(_REFUSAL)
    + _REFUSAL
)


class LimitedH11Protocol(OpenAIErrorH11Protocol):
    """OpenAIErrorH11Protocol with a request-head deadline and a cap on open connections.
    `configured(limits)` makes the subclass uvicorn instantiates per connection."""

    limits = ConnectionLimits()

    @classmethod
    def configured(cls, limits: ConnectionLimits) -> type["LimitedH11Protocol"]:
        return type(cls.__name__, (cls,), {"limits": limits})

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.idle_since = self.loop.time()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_deadline)
        if len(self.connections) > self.limits.max_connections and not self._evict_idlest():
            transport.write(REFUSAL_503)
            transport.close()

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _evict_idlest(self) -> bool:
        """Close the open connection idle the longest (not this one); False if all are busy."""
        idle = [c for c in self.connections if c is not self and isinstance(c, LimitedH11Protocol) and not c._busy()]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.idle_since)
        victim._head_timer.cancel()
        victim.transport.close()
        return True

    def _head_deadline(self) -> None:
        if not self._busy() and not self.transport.is_closing():
            self.transport.close()  # no complete request head in time: an idle socket or a dripper

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.idle_since = self.loop.time()
        self._head_timer.cancel()
        wait = self.limits.keepalive_timeout + self.limits.header_timeout
        self._head_timer = self.loop.call_later(wait, self._head_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)
