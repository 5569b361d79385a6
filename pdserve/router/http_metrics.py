"""HTTP-level router metrics whose label values stay bounded whatever clients send.

A label taken from the raw request path lets any client mint one time series
per distinct URL (a scanner probing 20,000 paths makes 20,000 series and can
exhaust Prometheus). Labels here come only from the app's own route templates,
so the series count is fixed by the code, not by traffic.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

OTHER_ROUTE = "other"


def route_template(routes: list[BaseRoute], scope: Scope) -> str:
    """The path template of the route that `scope` matches (e.g. `/v1/completions`), else `other`.

    Matching by path only (Match.PARTIAL counts: a wrong method still names a known route,
    and its 405 is worth seeing under that route).
    """
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return getattr(route, "path", OTHER_ROUTE)
    return OTHER_ROUTE


class HttpMetrics:
    """Request counter by route template and status code, registered on the router's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self.requests = Counter(
            "pdserve_router_requests",
            "HTTP requests by route template and status code",
            ["model_name", "route", "status"],
            registry=registry,
        )

    def observe(self, routes: list[BaseRoute], scope: Scope, status: int) -> None:
        """Count one finished HTTP request."""
        self.requests.labels(self.model_name, route_template(routes, scope), str(status)).inc()
