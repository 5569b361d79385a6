"""Cluster: the router's view of the nodes — load, health, choice, retries and request migration."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from pdserve.node_runtime import cluster_tls, keepalive
from pdserve.node_runtime.auth import cluster_metadata
from pdserve.node_runtime.discovery import Discovery, Role
from pdserve.openai_api.errors import NoCapacityError, UpstreamError, UpstreamInvalidRequest
from pdserve.router.attempt import attempt_request, salt_of
from pdserve.router.admission import DEFAULT_MAX_WAITING, AdmissionQueue
from pdserve.router.backoff import backoff_delay
from pdserve.router.balancer import DecodeBalancer, NodeLoad, PrefillBalancer
from pdserve.router.deadlines import Deadlines, StreamStalled, TokenDeadline, events_within_deadline
from pdserve.router.kv_routing import ROUTING_MODES, KvRouter, Routing
from pdserve.router.kv_subscriber import KvSubscriber
from pdserve.router.node_state import NodeState, Route
from pdserve.router.prefill_offload import Offload, OffloadPolicy, Prefilling
from pdserve.router.saturation import backlog_seconds
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger("pdserve.router")
RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
)


class Cluster:
    """Watches the members from discovery, polls their load and health, and runs requests."""

    def __init__(
        self,
        discovery: Discovery,
        *,
        cluster_secret: str = "",
        refresh_interval: float = 0.5,
        max_retries: int = 5,
        max_migrations: int = 3,
        backoff: float = 0.1,
        request_timeout: float = 600.0,
        deadlines: Deadlines | None = None,
        registry: CollectorRegistry | None = None,
        model_name: str = "unknown",
        tls: cluster_tls.ClusterTLS | None = None,
        routing: str = "kv-aware",
        kv_router: KvRouter | None = None,
        offload: OffloadPolicy | None = None,
        max_waiting_requests: int = DEFAULT_MAX_WAITING,
    ) -> None:
        if routing not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {routing!r}")
        self.discovery = discovery
        self.tls = tls
        """Mutual TLS to the nodes (None: plaintext)."""
        self.metadata = cluster_metadata(cluster_secret)
        self.refresh_interval = refresh_interval
        self.max_retries = max_retries
        self.max_migrations = max_migrations
        self.backoff = backoff
        self.request_timeout = request_timeout
        self.deadlines = deadlines or Deadlines()
        self.token_deadline = TokenDeadline(self.deadlines)
        self.nodes: dict[tuple[str, str], NodeState] = {}
        self.decode_balancer = DecodeBalancer()
        self.prefill_balancer = PrefillBalancer()
        self.routing = routing
        self.kv_router = kv_router or KvRouter(
            decode_balancer=self.decode_balancer, prefill_balancer=self.prefill_balancer
        )
        self.offload = offload or OffloadPolicy()
        """When a decode node prefills a prompt itself because every prefill node is saturated."""
        self._task: asyncio.Task | None = None
        r = registry or CollectorRegistry()
        self.retries = Counter(
            "pdserve_router_retries", "requests retried before the first token", ["model_name"], registry=r
        ).labels(model_name)
        self.migrations = Counter(
            "pdserve_router_migrations", "streams moved to another decode node", ["model_name"], registry=r
        ).labels(model_name)
        self.offload_held = Counter(
            "pdserve_router_offload_held",
            "prompts sent to a saturated prefill node because prefilling them on the decode node would "
            "push its streams past --tpot-slo",
            ["model_name"],
            registry=r,
        ).labels(model_name)
        self.queue = AdmissionQueue(max_waiting_requests, r, model_name, self.deadlines.capacity_wait)
        """Requests waiting for a decode node with room, in arrival order (router/admission.py)."""

    async def start(self) -> None:
        await self.discovery.start()
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        await self.discovery.stop()
        for node in self.nodes.values():
            if node.kv is not None:
                await node.kv.stop()
            await node.channel.close()

    def _sync_members(self) -> None:
        current = {(m.role, m.address): m for role in (Role.PREFILL, Role.DECODE) for m in self.discovery.members(role)}
        for key in list(self.nodes):
            if key not in current:
                asyncio.create_task(self._forget(self.nodes.pop(key)))
        for key, member in current.items():
            if key not in self.nodes:
                # keepalive pings: a partitioned node fails the calls in flight on it (UNAVAILABLE)
                channel = cluster_tls.channel(
                    member.address, self.tls, keepalive.client_options(self.deadlines.hung_after)
                )
                stub_class = decode_pb2_grpc.DecodeStub if member.role == Role.DECODE else prefill_pb2_grpc.PrefillStub
                stub = stub_class(channel)
                node = NodeState(member, channel, stub, health_pb2_grpc.HealthStub(channel), NodeLoad(member.address))
                if self.routing == Routing.KV_AWARE:
                    node.kv = KvSubscriber(member.address, stub, self.kv_router.index, self.metadata)
                    node.kv.start()
                self.nodes[key] = node

    @staticmethod
    async def _forget(node: NodeState) -> None:
        """A node left discovery: stop following its KV events (dropping its entries), close its channel."""
        if node.kv is not None:
            await node.kv.stop()
        await node.channel.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval)
            try:
                self._sync_members()
                for node in list(self.nodes.values()):
                    # each node on its own task: a hung node's probe never delays the others'
                    if node.probe is None or node.probe.done():
                        node.probe = asyncio.create_task(self._probe(node))
            except Exception:  # never let the health loop die
                log.exception("cluster refresh failed")

    async def refresh(self) -> None:
        self._sync_members()
        await asyncio.gather(*[self._probe(n) for n in list(self.nodes.values())])

    async def _probe(self, node: NodeState) -> None:
        """Active health check (gRPC health) plus a load report, each within the health deadline."""
        timeout = self.deadlines.health_timeout
        was_usable = node.usable
        try:
            await self._check(node, timeout)
        finally:
            if was_usable and not node.usable and node.kv is not None:
                node.kv.reset("unusable")  # never route on what a dead or hung node held

    async def _check(self, node: NodeState, timeout: float) -> None:
        sent = time.monotonic()  # the node's silence starts no later than this probe
        try:
            status = await node.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            report = await node.stub.GetLoad(common_pb2.LoadRequest(), metadata=self.metadata, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if node.missed_probe(sent):
                log.warning(
                    "%s %s missed a health check (%s): no new requests until it answers",
                    node.member.role,
                    node.member.address,
                    e.code().name,
                )
            return
        serving = status.status == health_pb2.HealthCheckResponse.SERVING
        if node.answered_probe(report, serving, self.deadlines.hung_after):
            log.warning(
                "%s %s answers its probes, but its engine has computed nothing for %.0f s: hung",
                node.member.role,
                node.member.address,
                report.engine_stalled_seconds,
            )
        self.kv_router.index.set_capacity(node.member.address, report.num_total_blocks)

    def _waited_on(self, decode: NodeState, prefills: list[str], first: bool) -> list[NodeState]:
        """The nodes an attempt waits on: its decode node, and until its first event (the KV has not
        arrived) its prefill nodes too."""
        found = [self.nodes.get(("prefill", a)) for a in prefills] if first else []
        return [decode, *(n for n in found if n is not None)]

    def _progress_of(self, decode: NodeState, prefills: list[str], first: bool) -> int:
        """What the nodes an attempt waits on have computed (reported layers): while this grows, a
        late event is a busy node's."""
        return sum(n.progress for n in self._waited_on(decode, prefills, first))

    def _hung_in(self, decode: NodeState, prefills: list[str], first: bool) -> str | None:
        """The address of a hung node an attempt waits on; None while they all live."""
        return next(
            (n.member.address for n in self._waited_on(decode, prefills, first) if n.hung(self.deadlines.hung_after)),
            None,
        )

    def _usable(self, role: str) -> list[NodeState]:
        return [n for (r, _), n in self.nodes.items() if r == role and n.usable]

    def is_healthy(self) -> bool:
        """For /health: a decode node is reachable (it prefills locally when no prefill node is). A node
        that only missed a health deadline counts (a loaded machine is slow, not down); requests still
        wait for a responsive one (capacity_wait)."""
        return any(n.reachable for (r, _), n in self.nodes.items() if r == Role.DECODE)

    def max_model_len(self) -> int | None:
        lens = [n.max_model_len for n in self._usable("decode") if n.max_model_len]
        return min(lens) if lens else None

    def snapshot(self) -> list[dict]:
        """What /v1/cluster shows of each node."""
        return [n.describe(self.deadlines.hung_after) for n in self.nodes.values()]

    def _choose(
        self, tokens_needed: int, exclude: set[str], prompt: Sequence[int] = (), cache_salt: str | None = None
    ) -> Route:
        usable = self._usable("decode")
        decodes = [n for n in usable if n.member.address not in exclude] or usable  # excluded ones as a last resort
        prefills = self._usable("prefill")
        if not decodes:  # with no usable prefill node, the decode node prefills locally (no addresses)
            raise NoCapacityError("no healthy decode node is available; try again later")
        by_load = {id(n.load): n for n in decodes}
        loads, now = [n.load for n in decodes], time.monotonic()
        prompt_tokens = len(prompt) or tokens_needed
        # local_tokens: what the decode node would compute itself (kv-aware routing knows its cached prefix)
        if self.routing == Routing.KV_AWARE:
            choice = self.kv_router.choose_decode(loads, prompt, cache_salt, tokens_needed, now)
            chosen, local_tokens = (choice.node, choice.uncached_tokens) if choice else (None, 0)
        else:
            chosen, local_tokens = self.decode_balancer.pick(loads, tokens_needed, now), prompt_tokens
        if chosen is None:
            raise NoCapacityError("no decode node has room for this request now; try again later")
        prefill_full = bool(prefills) and all(self._saturated(n.load) for n in prefills)
        decode_full = self._saturated(chosen)
        if decode_full and (prefill_full or not prefills):
            raise NoCapacityError("every node has its fill of queued prompts; try again later")
        self.decode_balancer.assign(chosen, tokens_needed)
        # every prefill node saturated (backlog in seconds) but this decode node not: it prefills
        loads = [n.load for n in prefills]
        offload = Offload.REMOTE if decode_full else self.offload.decide(loads, chosen, local_tokens)
        if offload is Offload.HELD:
            self.offload_held.inc()
        if prefill_full or offload is Offload.LOCAL:
            self.offload.assign_local(chosen, local_tokens)
            # no addresses: the decode node prefills the prompt itself
            return Route(by_load[id(chosen)], [], (), Prefilling(chosen, prompt_tokens))
        cached: tuple[int, ...] = ()
        open_loads = [n.load for n in prefills if not self._saturated(n.load)]  # saturated ones get nothing new
        if self.routing == Routing.KV_AWARE:  # counts the uncached tokens on the first node itself
            order = self.kv_router.order_prefill(open_loads, prompt, cache_salt)
            ordered = order.nodes[:3]
            cached = tuple(order.cached_tokens[n.address] for n in ordered)
        else:
            ordered = self.prefill_balancer.order(open_loads)[:3]
            if ordered:
                ordered[0].inflight_tokens += prompt_tokens
        if not ordered:  # none usable: the decode node prefills locally
            self.offload.assign_local(chosen, local_tokens)
        target = ordered[0] if ordered else chosen
        return Route(by_load[id(chosen)], [n.address for n in ordered], cached, Prefilling(target, prompt_tokens))

    def _saturated(self, load: NodeLoad) -> bool:
        """The node already has `max_prefill_backlog` seconds of this router's prompts pending
        (router/saturation.py): a new prompt waits in the admission queue instead of behind them."""
        limit = self.deadlines.prefill_backlog
        return limit > 0 and backlog_seconds(load.prefilling_tokens, load.prefill_rate) >= limit

    def _prefilling(self, node: NodeState, prefills: list[str], tokens: int) -> Prefilling:
        """Count the prompt on the node that prefills it (the first prefill address, else the decode
        node) until its first token: the pending work `OffloadPolicy` compares."""
        target = self.nodes.get(("prefill", prefills[0])) if prefills else node
        return Prefilling((target or node).load, tokens)

    def check_admission(self) -> None:
        """QueueFull (503 with Retry-After) when the admission queue is full: asked before any work."""
        self.queue.check()

    async def _choose_waiting(
        self,
        tokens_needed: int,
        exclude: set[str],
        prompt: Sequence[int] = (),
        cache_salt: str | None = None,
        new: bool = True,
    ) -> Route:
        """_choose, at once when nobody waits ahead; else in the admission queue's order, waiting up to
        capacity_wait for a node to come back or to free room. `new`: a request's first attempt (a
        retry or migration goes ahead of new requests, is never refused for a full queue, and waits
        `max_prefill_backlog` longer: work was done for it, and saturated nodes drain in that time)."""
        wait = self.deadlines.capacity_wait + (0.0 if new else self.deadlines.prefill_backlog)
        choose = lambda: self._choose(tokens_needed, exclude, prompt, cache_salt)  # noqa: E731
        return await self.queue.route(choose, new, wait, min(0.2, self.refresh_interval))

    async def admit(self, request: decode_pb2.GenerateRequest) -> Route:
        """A route for a request's first attempt, waiting in the admission queue when the nodes are
        full; NoCapacityError (503) when none frees up in `capacity_wait`. The HTTP layer asks this
        before it answers, so a refusal is a status code, never an error inside a started stream."""
        prompt = list(request.prompt_token_ids)
        needed = len(prompt) + request.params.max_tokens
        return await self._choose_waiting(needed, set(), prompt, salt_of(request))

    async def generate(
        self, request: decode_pb2.GenerateRequest, route: Route | None = None
    ) -> AsyncIterator[decode_pb2.GenerateEvent]:
        """Stream one request's events (those with tokens or its end); retries before the first token,
        migrates after it (no gap, no duplicate), and the last event's usage is the whole request's.
        Each attempt sends a copy of `request` (`attempt_request`) named after its `request_id`; its
        `cache_salt` (vLLM's field) limits prefix-cache hits to requests with the same salt. `route`:
        the first attempt's, from `admit` (None: chosen here)."""
        prompt, salt = list(request.prompt_token_ids), salt_of(request)
        sent: list[int] = []
        tried: set[str] = set()
        retries = migrations = 0
        while True:
            if route is None:
                needed = len(prompt) + request.params.max_tokens  # what was sent plus what remains
                route = await self._choose_waiting(needed, tried, prompt + sent, salt, new=not (retries or sent))
            node, prefills, prefill_cached, prefilling = route
            route = None
            attempt_id = f"{request.request_id}-{retries}-{migrations}"
            req = attempt_request(request, attempt_id, sent, prefills, prefill_cached)
            call = node.stub.Generate(req, metadata=self.metadata, timeout=self.request_timeout)
            sent_before = len(sent)
            prefilling = prefilling or self._prefilling(node, prefills, len(req.prompt_token_ids))
            stream = node.load.streams.open(req.params.max_tokens)  # its pace guards the offload
            try:
                hung = partial(self._hung_in, node, prefills)
                progress = partial(self._progress_of, node, prefills)
                async for event in events_within_deadline(call, self.token_deadline, hung, progress):
                    if event.token_ids:
                        sent.extend(event.token_ids)
                        prefilling.first_token()
                        node.load.streams.arrived(stream, len(event.token_ids), time.monotonic())
                    if event.finish_reason:  # the node counted this attempt's prompt and tokens
                        event.usage.prompt_tokens, event.usage.completion_tokens = len(prompt), len(sent)
                    if event.token_ids or event.finish_reason:
                        yield event
                    if event.finish_reason:
                        return
                raise UpstreamError(f"decode node {node.member.address} ended the stream without finishing")
            except (grpc.aio.AioRpcError, StreamStalled) as e:
                code = e.code() if isinstance(e, grpc.aio.AioRpcError) else grpc.StatusCode.DEADLINE_EXCEEDED
                details = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise UpstreamInvalidRequest(details or "invalid request") from None
                if code not in RETRYABLE and not isinstance(e, StreamStalled):
                    raise UpstreamError(f"decode node {node.member.address}: {code.name} {details}") from None
                if code == grpc.StatusCode.UNAVAILABLE:
                    node.breaker.failure()
                if isinstance(e, StreamStalled) and e.culprit in (None, node.member.address):
                    node.responsive = False  # until its next probe answers in time
                    node.stalled = node.stalled or e.culprit is None
                if not isinstance(e, StreamStalled) or e.culprit in (None, node.member.address):
                    tried.add(node.member.address)  # a hung prefill node is no fault of this decode node
                if len(sent) == sent_before:  # no progress on this attempt (e.g. its prefill failed): a retry
                    retries += 1
                    if retries > self.max_retries:
                        raise NoCapacityError(f"request failed after {self.max_retries} retries: {details}") from None
                    self.retries.inc()
                    await asyncio.sleep(backoff_delay(self.backoff, retries))
                else:  # the stream moved on and then failed: migrate what was sent; retries start over
                    retries = 0
                    migrations += 1
                    if migrations > self.max_migrations:
                        raise UpstreamError(f"stream failed after {self.max_migrations} migrations") from None
                    self.migrations.inc()
                    log.warning("migrating %s after %d tokens: %s", request.request_id, len(sent), code.name)
            finally:
                node.load.streams.close(stream)
                prefilling.done()
                call.cancel()  # no-op when the stream ended; frees the node's request when it was abandoned
                asyncio.create_task(self._probe(node))  # refresh the load right after a response
