"""Running the router's ASGI app under uvicorn with its connection limits (router.http_limits)."""

from __future__ import annotations

import importlib.util
import logging
import socket
from collections.abc import Callable

from pdserve.router.http_limits import ConnectionLimits, LimitedH11Protocol, raise_nofile_limit

log = logging.getLogger("pdserve.router")


def serve_http(
    app,
    host: str,
    port: int,
    limits: ConnectionLimits,
    *,
    log_level: str = "info",
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    graceful_timeout: float = 30.0,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Serve `app` until SIGTERM/SIGINT: soft nofile raised to the hard limit first, the connection
    cap fitted below it, idle and slow-header connections closed (LimitedH11Protocol).
    `on_listening` runs once the socket accepts connections: uvicorn runs the app's startup handlers
    before it binds, so a READY line printed there let a client connect too early (refused) and
    preceded a failure to bind."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and on_listening is not None:
                on_listening()

    nofile = raise_nofile_limit()
    fitted = limits.for_fd_limit(nofile)
    if fitted.max_connections < limits.max_connections:
        log.warning(
            "open-file limit %d: at most %d client connections (raise `ulimit -n` for more)",
            nofile,
            fitted.max_connections,
        )
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop,
        log_level=log_level.lower(),
        http=LimitedH11Protocol.configured(fitted),
        ssl_certfile=ssl_certfile,
        ssl_keyfile=ssl_keyfile,
        access_log=False,
        timeout_keep_alive=int(max(1, fitted.keepalive_timeout)),
        timeout_graceful_shutdown=graceful_timeout,  # type: ignore[arg-type]  # a float works (asyncio timeout)
    )
    server = _Server(config)
    server.run()
    if not server.started:  # could not bind (uvicorn has logged why)
        raise SystemExit(1)
