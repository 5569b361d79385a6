"""The node's /metrics HTTP server: Prometheus text format, whatever the scraper asks for.

prometheus_client's own server negotiates OpenMetrics with a scraper that prefers it (Prometheus
does), and its OpenMetrics encoder (0.26) writes sample names with label-name escaping, which turns
`vllm:num_requests_running` into `vllm_num_requests_running`: every vLLM-named series would be lost
under another name. The text format (0.0.4) keeps colons, and every scraper reads it (Prometheus,
llm-d's endpoint picker, production-stack's router). The router's /metrics (router/app.py) serves
the same format.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer, _SilentHandler

PATHS = ("/", "/metrics")


def text_app(registry: CollectorRegistry) -> Callable:
    """A WSGI app answering GET / and /metrics with `registry` in the text format, 404 otherwise."""

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "/") not in PATHS:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found\n"]
        body = generate_latest(registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))])
        return [body]

    return app


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> ThreadingWSGIServer:
    """Serve `registry` on host:port from a daemon thread (as prometheus_client.start_http_server does)."""
    server = make_server(host, port, text_app(registry), ThreadingWSGIServer, handler_class=_SilentHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
