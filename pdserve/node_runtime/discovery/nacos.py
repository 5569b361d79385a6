"""Nacos discovery with nacos-sdk-python 2.0.x (the HTTP open API, /nacos/v1/ns/...).

Why 2.0.x and not 3.x: 3.x speaks only Nacos's gRPC protocol and installs a
top-level package named `v2`, which can clash with other code; 2.0.x's
`nacos.NacosClient` uses the plain HTTP naming API that Nacos 1.x/2.x servers
serve (and 3.x keeps behind its compatibility switch), which a small local
stand-in can implement faithfully for tests. No Nacos server runs on these
machines: the tests use such a stand-in, not a real server.

Nodes register as ephemeral instances of `<service>-<role>` with their ports
as metadata. Heartbeats are the SDK's own (`add_naming_instance(...,
heartbeat_interval=)`): its beat carries the full metadata, so when the server
has expired an instance (about 30 s without beats) and a beat re-creates it, no
metadata is lost. The router watches with the SDK's own `subscribe` (healthy
instances only) and applies its ADDED / MODIFIED / DELETED events. Two 2.0.x
quirks are handled here: its first poll notifies nothing (so `start` lists once
itself, and later ADDED events for known instances are idempotent), and its
poll timer stops for good on the first failed poll (so we mark the timer to
ignore errors: a registry outage keeps the last-known membership and the
subscription resumes afterwards). A node that dies between the SDK's first and
second poll raises no event; the router's own health checks cover that case.

Auth and TLS, as the SDK offers them (`NacosClient(..., username=, password=, ak=, sk=)`):
- username/password: the SDK logs in at POST /nacos/v1/auth/login (both in the query string) and
  adds the `accessToken` it gets to every later request, logging in again before the token's
  `tokenTtl` runs out. Its constructor would log in at once, synchronously; `_Client` defers that
  to the first request, which runs on our executor, so a registry that is down at start is retried
  as before and a rejection is reported by `_login` as one clear DiscoveryAuthError.
- access key/secret key: every naming request carries `ak`, `data` (`<ms timestamp>@@<group>@@
  <service>`, or `<ms timestamp>@@<service>` when the name already holds `@@`) and `signature`
  (base64 HMAC-SHA1 of `data` under the secret key) as query parameters; the `Spas-*` headers
  are only for the config API, which pdserve does not use.
- TLS: an `https://HOST:PORT` server address is used as is, but 2.0.x opens it with a bare
  `ssl.SSLContext()`, which checks no certificate. `_Client` hands it a verifying context
  instead (the system's CAs, or --nacos-tls-ca): the password travels in that connection.
Secrets never reach a log line: the SDK logs each request's URL (the login's holds the password)
at DEBUG and the access token at INFO, so `_Redact` scrubs its records.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import threading
import traceback
from typing import Any
from urllib.error import HTTPError
from urllib.parse import quote, quote_plus

import nacos  # nacos-sdk-python 2.0.x
import nacos.client

from pdserve.node_runtime.discovery.base import ROLES, Discovery, DiscoveryAuthError, DiscoveryError, Member

log = logging.getLogger("pdserve.discovery")

SDK_LOGGERS = ("nacos", "nacos.client")
"""The SDK's loggers (client.py and its beat threads use nacos.client; files.py uses nacos)."""
REFUSED = (401, 403)
"""HTTP statuses with which Nacos rejects credentials or denies access."""


class _Redact(logging.Filter):
    """Scrubs Nacos secrets from the SDK's own log records. One instance serves every client of the
    process (the SDK logs through module-level loggers); each client adds its password and secret
    key. Tokens are not known in advance, so they are matched by the shapes the SDK prints."""

    # `accessToken=T` in a logged URL, `'accessToken': 'T'` in a logged dict, `AccessToken: T` in the
    # login line; `password` likewise, in case a value is not among the registered secrets.
    SHAPES = re.compile(r"(?i)((?:accessToken|password)(?:=|': '|: ))[^&\s',}]+")

    def __init__(self) -> None:
        super().__init__()
        # replaced whole, never changed in place: the SDK's threads read it while a client adds to it
        self.secrets: tuple[str, ...] = ()

    def add(self, secret: str) -> None:
        if secret:
            # as given, as the SDK's urlencode writes it into a URL, and as repr() shows it in a dict
            forms = {secret, quote_plus(secret), quote(secret, safe=""), repr(secret)[1:-1]}
            # longest first: one form may contain another
            self.secrets = tuple(sorted(forms.union(self.secrets), key=len, reverse=True))

    def scrub(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return self.SHAPES.sub(r"\1***", text)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler's own error handling
            return True
        record.msg, record.args = self.scrub(message), None
        if record.exc_info:
            # The SDK logs a full traceback for every failed request (each poll, during an outage);
            # we report failures in one line of our own, so keep its traceback only at DEBUG.
            if logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
                record.exc_text = self.scrub("".join(traceback.format_exception(*record.exc_info)).rstrip())
            record.exc_info = None
        return True


_REDACT = _Redact()


def _guard_sdk_logs(*secrets: str) -> None:
    for secret in secrets:
        _REDACT.add(secret)
    for name in SDK_LOGGERS:
        logger = logging.getLogger(name)
        if _REDACT not in logger.filters:
            logger.addFilter(_REDACT)


_request_tls = threading.local()
"""The verifying SSL context of the client whose request runs on this thread (see _SslModule)."""


class _SslModule:
    """Stands in for the `ssl` module inside nacos.client, whose request code builds a fresh
    `ssl.SSLContext()` (no certificate check) for each request and offers no way to pass one. While
    one of our clients makes a request, its verifying context is returned instead; any other caller
    gets what the real module would give."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def SSLContext(self, *args: Any, **kwargs: Any) -> ssl.SSLContext:  # the name the SDK calls
        context = getattr(_request_tls, "context", None)
        return context if context is not None else self._real.SSLContext(*args, **kwargs)


def _install_ssl_hook() -> None:
    if not isinstance(nacos.client.ssl, _SslModule):
        nacos.client.ssl = _SslModule(nacos.client.ssl)


class _Client(nacos.NacosClient):
    """nacos.NacosClient with two changes: the login its constructor would do at once waits for the
    first request (see the module docstring), and https requests verify the server's certificate."""

    def __init__(self, server: str, namespace: str, tls: ssl.SSLContext | None, **auth: str | None) -> None:
        self._tls = tls
        if tls is not None:
            _install_ssl_hook()
        self._constructing = True
        super().__init__(server, namespace=namespace or None, **auth)
        self._constructing = False

    def get_access_token(self, force_refresh: bool = False) -> Any:
        if self._constructing:
            return None
        return super().get_access_token(force_refresh)

    def _do_sync_req(self, *args: Any, **kwargs: Any) -> Any:
        if self._tls is None:
            return super()._do_sync_req(*args, **kwargs)
        # restore rather than clear: a request logs in first, from inside this same call
        previous = getattr(_request_tls, "context", None)
        _request_tls.context = self._tls
        try:
            return super()._do_sync_req(*args, **kwargs)
        finally:
            _request_tls.context = previous


def _refused(e: BaseException) -> int | None:
    """The HTTP status with which Nacos refused a request, if it did. The SDK turns an HTTPError
    into NacosException("Insufficient privilege.") (403) or "Request Error, code is N" inside its
    `except` block, so the HTTPError is the exception's context."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, HTTPError) and seen.code in REFUSED:
            return seen.code
        seen = seen.__cause__ or seen.__context__
    return None


def _describe(e: BaseException) -> str:
    # The SDK's own messages; never a URL (HTTPError's str omits it: a login URL holds the password).
    if isinstance(e, HTTPError):
        return f"HTTP {e.code} {e.reason}"
    return str(e) or type(e).__name__


def _instance_id(host: dict) -> str:
    """Nacos's id of an instance (the key of the SDK's events), derived as Nacos does when absent."""
    return host.get("instanceId") or f"{host['ip']}#{host['port']}"


def _member(role: str, host: dict) -> Member:
    return Member(role, host["ip"], int(host["port"]), dict(host.get("metadata") or {}))


class NacosDiscovery(Discovery):
    """Registers members (nodes) and watches members (router) through a Nacos server."""

    def __init__(
        self,
        server: str,
        namespace: str = "",
        service: str = "pdserve",
        interval: float = 3.0,
        heartbeat: float = 5.0,
        *,
        username: str = "",
        password: str = "",
        access_key: str = "",
        secret_key: str = "",
        tls_ca: str = "",
    ) -> None:
        _guard_sdk_logs(password, secret_key)
        https = any(s.strip().lower().startswith("https://") for s in server.split(","))
        try:
            tls = ssl.create_default_context(cafile=tls_ca or None) if https else None
        except (OSError, ssl.SSLError) as e:  # a bad setting, as a bad flag value is
            raise ValueError(f"cannot load --nacos-tls-ca {tls_ca}: {e}") from None
        self.client = _Client(
            server,
            namespace,
            tls,
            username=username or None,
            password=password or None,
            ak=access_key or None,
            sk=secret_key or None,
        )
        self.server = server
        self.namespace = namespace
        self.username = username
        self.access_key = access_key
        self.service = service
        self.interval = interval
        self.heartbeat = heartbeat
        self._lock = threading.Lock()  # subscription events arrive on the SDK's timer threads
        self._members: dict[str, dict[str, Member]] = {}  # role -> instance id -> member
        self._registered: list[Member] = []
        self._tasks: list[asyncio.Task] = []

    def service_name(self, role: str) -> str:
        return f"{self.service}-{role}"

    def instance(self, member: Member) -> tuple[str, str, int]:
        """(service name, ip, port): what Nacos identifies a registered instance by."""
        return self.service_name(member.role), member.host, member.port

    async def _call(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    def _refusal(self, what: str, code: int) -> DiscoveryAuthError:
        """The error for a request Nacos refused: which credentials to check (never their values)."""
        if self.access_key:
            hint = (
                f"check --nacos-access-key {self.access_key!r} and its secret key"
                f"{' and the permissions of user ' + repr(self.username) if self.username else ''}"
            )
        elif self.username:
            hint = f"check that user {self.username!r} may use namespace {self.namespace or 'public'!r}"
        else:
            hint = "this Nacos requires auth: set --nacos-username with $PDSERVE_NACOS_PASSWORD, or --nacos-access-key"
        return DiscoveryAuthError(f"{what}: nacos at {self.server} refused it (HTTP {code}); {hint}")

    def _failure(self, what: str, e: BaseException) -> DiscoveryError:
        code = _refused(e)
        if code is not None:
            return self._refusal(what, code)
        return DiscoveryError(f"{what}: nacos at {self.server} failed: {_describe(e)}")

    async def _login(self) -> None:
        """Log in now (username/password), so that a rejected password is reported as such rather
        than as the 403 of whatever request would have logged in first."""
        if not self.username:
            return
        try:
            await self._call(self.client.get_access_token)
        except Exception as e:
            code = _refused(e)
            if code is not None:
                raise DiscoveryAuthError(
                    f"nacos at {self.server} rejected the login of user {self.username!r} (HTTP {code}): "
                    "check --nacos-username and the password ($PDSERVE_NACOS_PASSWORD, --nacos-password-file)"
                ) from None
            raise DiscoveryError(f"cannot log in to nacos at {self.server}: {_describe(e)}") from None

    async def check(self) -> None:
        try:
            await self._login()
        except DiscoveryAuthError:
            raise
        except DiscoveryError as e:  # down or unreachable: the caller's retries cover it
            log.warning("%s; retrying", e)

    async def start(self) -> None:
        await self.check()
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._subscribe_all()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.client.stop_subscribe()
        for member in list(self._registered):
            await self.deregister(member)

    async def register(self, member: Member) -> None:
        """Register and start the SDK's beat; DiscoveryError (DiscoveryAuthError if refused) says why not."""
        await self._login()
        meta = {"role": member.role, **{k: str(v) for k, v in member.metadata.items()}}
        what = f"registering {member.role} node {member.address}"
        try:
            accepted = await self._call(
                self.client.add_naming_instance,
                *self.instance(member),
                metadata=meta,
                ephemeral=True,
                heartbeat_interval=self.heartbeat,
            )
        except Exception as e:
            raise self._failure(what, e) from None
        if not accepted:  # the SDK starts no beat then, so the instance would expire unseen
            raise DiscoveryError(f"{what}: nacos at {self.server} did not answer ok")
        self._registered.append(member)

    async def deregister(self, member: Member) -> None:
        try:
            await self._call(self.client.remove_naming_instance, *self.instance(member), ephemeral=True)
        except Exception as e:  # the registry may be gone at shutdown; the instance then expires
            log.warning("nacos deregister of %s failed: %s", member.address, e)
            # The SDK stops its beat thread only after a successful removal; stop it here too
            # (its task table is keyed "service#ip#port" in 2.0.x).
            task = self.client.heartbeats.pop("#".join(map(str, self.instance(member))), None)
            if task is not None:
                task.stop()
        if member in self._registered:
            self._registered.remove(member)

    async def _subscribe_all(self) -> None:
        """Subscribe to each role; a registry down now is retried (subscribe's first poll is synchronous)."""
        from nacos.listener import SubscribeListener

        pending = list(ROLES)
        while pending:
            role, name = pending[0], self.service_name(pending[0])
            listener = SubscribeListener(lambda event, slc, role=role: self._on_event(role, event, slc), "pdserve")
            try:
                await self._call(self.client.subscribe, listener, self.interval, name, healthy_only=True)
            except Exception as e:
                failure = self._failure(f"subscribing to {name}", e)
                # refused here, after start() got in: the credentials changed; say so, keep trying
                level = logging.ERROR if isinstance(failure, DiscoveryAuthError) else logging.WARNING
                log.log(level, "%s; retrying", failure)
                await asyncio.sleep(self.interval)
                continue
            timer = self.client.subscribe_timer_manager.all_timers().get(f"service-subscribe-timer-{name}")
            if timer is not None:
                timer.set_ignore_ex(True)
            pending.pop(0)

    def _on_event(self, role: str, event: str, slc) -> None:
        with self._lock:
            known = self._members.setdefault(role, {})
            if event == "DELETED" or not slc.instance.get("enabled", True):
                known.pop(slc.instance_id, None)
            else:
                known[slc.instance_id] = _member(role, slc.instance)

    async def refresh(self) -> None:
        """One full healthy listing per role (at start; the subscription keeps it current after). A
        registry that is down keeps the last known view; one that refuses us raises DiscoveryAuthError."""
        for role in ROLES:
            try:
                reply = await self._call(self.client.list_naming_instance, self.service_name(role), healthy_only=True)
            except Exception as e:
                code = _refused(e)
                if code is not None:
                    raise self._refusal(f"listing the {role} nodes", code) from None
                log.warning(
                    "nacos unreachable (%s); keeping %d known %s nodes", e, len(self._members.get(role, {})), role
                )
                continue
            hosts = reply.get("hosts", []) if isinstance(reply, dict) else []
            with self._lock:
                self._members[role] = {_instance_id(h): _member(role, h) for h in hosts if h.get("enabled", True)}

    def members(self, role: str) -> list[Member]:
        with self._lock:
            return sorted(self._members.get(role, {}).values(), key=lambda m: (m.host, m.port))
