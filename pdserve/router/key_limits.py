"""Per-API-key limits: a client that sends too much gets a 429 with Retry-After before any work, and
cannot take the capacity every other key shares.

Two limits, each off by default and each the same for every key (`--api-key-max-in-flight`,
`--api-key-rpm`):

- in flight: a key's POST requests to /v1/* that have not finished (a stream counts until its last
  byte is sent);
- requests per minute: a token bucket per key holding up to one minute's worth, refilled evenly, so
  a key may burst to its limit and then sends at its rate.

The middleware sits inside the API-key check, so only keys that authenticated have state here: the
memory is bounded by the number of configured keys. Limits without keys are refused at start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from pdserve.openai_api.errors import RateLimited, bearer_key
from pdserve.router.body_limit import send_error


@dataclass(frozen=True)
class KeyLimits:
    """Limits that apply to each API key separately (0: none)."""

    api_key_max_in_flight: int = 0
    """Requests one API key may have running at once; more get 429 with Retry-After (0: no limit)."""
    api_key_rpm: int = 0
    """Requests one API key may start per minute (bursts up to it); more get 429 with Retry-After
    (0: no limit)."""

    def __post_init__(self) -> None:
        for name in ("api_key_max_in_flight", "api_key_rpm"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: no limit), got {getattr(self, name)}")

    @property
    def any(self) -> bool:
        return bool(self.api_key_max_in_flight or self.api_key_rpm)

    def check_keys(self, keys: tuple[str, ...] | list[str]) -> None:
        """ValueError naming the flag when a per-key limit is set but no key is configured."""
        if self.any and not keys:
            flag = "--api-key-max-in-flight" if self.api_key_max_in_flight else "--api-key-rpm"
            raise ValueError(
                f"{flag} limits each API key, but no key is configured (--api-key-file or $PDSERVE_API_KEY)"
            )


class _KeyState:
    __slots__ = ("in_flight", "tokens", "stamp")

    def __init__(self, rpm: int, now: float) -> None:
        self.in_flight = 0
        self.tokens = float(rpm)
        self.stamp = now


class KeyLimiter:
    """The per-key counters and buckets (one event loop: no locks)."""

    def __init__(self, limits: KeyLimits, registry: CollectorRegistry, model_name: str) -> None:
        self.limits = limits
        self._keys: dict[bytes, _KeyState] = {}
        self.refused = Counter(
            "pdserve_router_rate_limited",
            "requests refused with 429 for their API key's limit",
            ["model_name", "limit"],
            registry=registry,
        )
        self._in_flight_refused = self.refused.labels(model_name, "in_flight")
        self._rpm_refused = self.refused.labels(model_name, "rpm")

    def acquire(self, key: bytes, now: float | None = None) -> _KeyState:
        """Count a request of `key` (RateLimited when over a limit); `release` it when it ends."""
        now = time.monotonic() if now is None else now
        rpm, most = self.limits.api_key_rpm, self.limits.api_key_max_in_flight
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _KeyState(rpm, now)
        if most and state.in_flight >= most:
            self._in_flight_refused.inc()
            raise RateLimited(f"this API key already has {state.in_flight} requests running (limit {most})", 1.0)
        if rpm:
            state.tokens = min(float(rpm), state.tokens + (now - state.stamp) * rpm / 60.0)
            state.stamp = now
            if state.tokens < 1.0:
                self._rpm_refused.inc()
                raise RateLimited(
                    f"this API key sent more than {rpm} requests in a minute", (1.0 - state.tokens) * 60.0 / rpm
                )
            state.tokens -= 1.0
        state.in_flight += 1
        return state

    @staticmethod
    def release(state: _KeyState) -> None:
        state.in_flight -= 1


class KeyLimit:
    """ASGI middleware: POST /v1/* requests count against their Bearer key's limits."""

    def __init__(self, app, limiter: KeyLimiter) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        # the Bearer key of the first Authorization header: the one the API-key guard outside this
        # middleware checked (so only configured keys get state here)
        header = next((v for n, v in scope.get("headers", ()) if n == b"authorization"), b"")
        key = bearer_key(header)
        try:
            state = self.limiter.acquire(key)
        except RateLimited as e:
            return await send_error(send, e)
        try:
            await self.app(scope, receive, send)  # returns when the response (a whole stream) is sent
        finally:
            self.limiter.release(state)
