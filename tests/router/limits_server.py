"""`python -m tests.router.limits_server PORT MAX_CONNECTIONS HEADER_TIMEOUT FIRST_DELAY [BODY_TIMEOUT]`: the router's
HTTP app over a paced fake cluster, served exactly as `pdserve router` serves it (serve_http), for
tests that need a separate process (an fd limit of its own)."""

from __future__ import annotations

import sys

from pdserve.engine.builtin import default_model_dir
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.app import create_app
from pdserve.router.http_limits import ConnectionLimits
from pdserve.router.http_server import serve_http
from pdserve.router.serving import Server
from tests.router.paced import PacedCluster


def main(port: int, max_connections: int, header_timeout: float, first_delay: float, body_timeout: float) -> None:
    cluster = PacedCluster(list(range(300, 308)), first_delay=first_delay)
    app = create_app(Server(cluster, Tokenizer(default_model_dir("tiny")), "m", 128), body_timeout=body_timeout)

    limits = ConnectionLimits(
        header_timeout=header_timeout, keepalive_timeout=1.0, max_connections=max_connections, body_timeout=body_timeout
    )
    serve_http(
        app,
        "127.0.0.1",
        port,
        limits,
        log_level="warning",
        graceful_timeout=1.0,
        on_listening=lambda: print(f"READY limits http://127.0.0.1:{port}", flush=True),
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), float((sys.argv + ["60"])[5]))
