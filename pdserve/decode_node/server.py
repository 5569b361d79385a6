"""DecodeNode: gRPC `Decode` service — admission, remote prefill over CacheStore, token streaming."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2

from pdserve.cachestore import SessionError, Transport
from pdserve.decode_node.kv_pull import PullSender
from pdserve.decode_node.prefill_client import PrefillClients
from pdserve.engine.kv_connector import KvSource
from pdserve.engine.prompt_check import check_prompt
from pdserve.engine.remote_prefill import DO_REMOTE_PREFILL, RemotePrefillPolicy
from pdserve.engine.request import StepOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_runtime import convert, kv_store
from pdserve.node_runtime.grpc_errors import NodeUnavailable
from pdserve.node_runtime.kv_events_service import KvEventsServicer
from pdserve.node_runtime.node import NodeRuntime
from pdserve.node_runtime.node_request import NodeRequest
from pdserve.node_runtime.node_config import NodeConfig
from pdserve.node_runtime.rank_kv_driver import (
    RECEIVER,
    RankEndpoints,
    RankKVError,
    endpoint_options,
    with_rank_service,
)
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2

log = logging.getLogger("pdserve.decode")
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
"""A prefill node's answers that no other prefill node would change: passed on, not retried elsewhere."""


class DecodeNode(KvEventsServicer, decode_pb2_grpc.DecodeServicer):
    """Decode-driven flow: match the prompt against this node's prefix cache; prefill here when the
    missing part is short or no prefill node is usable (the engine's `RemotePrefillPolicy`
    connector); otherwise share the
    held blocks, open a CacheStore session over the missing ones, call a prefill node, wait for the
    KV by notification (other requests keep decoding), then stream tokens.

    The Generate stream is the request's session: however it ends, the CacheStore session is
    closed, the node waits until no writer can touch the blocks, and only then frees them."""

    def __init__(self, config: NodeConfig) -> None:
        self.kv_reuse = config.node.kv_reuse
        self.local_prefill_max_tokens = config.node.local_prefill_max_tokens
        policy = RemotePrefillPolicy(reuse=self.kv_reuse, local_max_tokens=self.local_prefill_max_tokens)
        self.rt = NodeRuntime("decode", with_rank_service(config, RECEIVER), policy)
        self.advertise_host = config.node.advertise_host
        """Host prefill nodes use to reach our CacheStore listener (needed when bound to 0.0.0.0)."""
        self.cachestore = kv_store.receiver(self.rt, config)
        tls = config.node.tls()
        self.prefills = PrefillClients(
            config.node.cluster_secret, self.rt.compatibility, config.transfer.peer_timeout, tls
        )
        self.pulls = PullSender(
            kv_store.sender(self.rt, config, self.cachestore.metrics, self.cachestore.active_transport),
            self.prefills,
            self.rt.engine.block_manager.block_size,
            # a pull sends one pool: not from a tensor-parallel node, whose ranks each hold some heads
            config.node.kv_pull_min_blocks if self.kv_reuse and config.engine.tensor_parallel_size == 1 else 0,
            self.rt.metrics.registry,
            self.rt.metrics.model_name,
        )
        """D->P pulls: held prefix blocks sent to a prefill node that lacks them (`pdserve.decode_node.kv_pull`)."""
        self.ranks = RankEndpoints(self.rt.engine.runner, self.rt.metrics.registry, self.rt.metrics.model_name)
        """The CacheStore receivers of tensor-parallel ranks 1.. (none with TP=1)."""
        self._remote_kv = not self.ranks.ranks or self.cachestore.active_transport != Transport.LOCAL
        """Whether KV can come from a prefill node: every rank must be reachable by the transport."""

    async def start(self) -> str:
        loop = asyncio.get_running_loop()

        def on_listener_change(up: bool) -> None:
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._report_listener()))

        self.cachestore.on_listener_change = on_listener_change
        await kv_store.start_receiver(self.cachestore, self.advertise_host)
        if self._remote_kv and self.ranks.ranks:
            endpoints = await self.ranks.start_receivers(
                **endpoint_options(self.rt.config, self.cachestore.active_transport)
            )
            log.info("tensor-parallel ranks 1..%d receive their KV heads on %s", len(endpoints), ", ".join(endpoints))
        return await self.rt.start(lambda server: decode_pb2_grpc.add_DecodeServicer_to_server(self, server))

    async def _report_listener(self) -> None:
        """A decode node whose CacheStore listener cannot accept (e.g. out of fds) gets no KV:
        health says NOT_SERVING until accept works again."""
        if self.rt.draining or self.rt.server is None:
            return
        up = self.cachestore.listening
        if not up:
            log.error("cachestore listener is not accepting: health NOT_SERVING")
        await self.rt.health.set(
            "", health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    def discovery_meta(self) -> dict[str, str]:
        return {"cachestore_port": self.cachestore.endpoint.rsplit(":", 1)[-1]}

    async def stop(self, drain: bool = False) -> None:
        await self.rt.stop(drain)
        await self.cachestore.stop()
        await self.prefills.close()
        await self.pulls.client.close()

    async def GetLoad(self, request, context) -> common_pb2.LoadReport:
        return await self.rt.load_report()

    async def Generate(self, request: decode_pb2.GenerateRequest, context) -> AsyncIterator[decode_pb2.GenerateEvent]:
        rt = self.rt
        rid, prompt, params, salt = self._parse(request)
        # the local transport cannot reach ranks 1.. (other processes): such a node prefills itself
        addresses = list(request.prefill_addresses) if self._remote_kv else []
        await rt.compile_grammar(params)
        async with rt.request(
            rid,
            self._end,
            event="admit",
            prompt_tokens=len(prompt),
            max_tokens=params.max_tokens,
            prefill=",".join(addresses) or "local",
        ) as scope:
            plan = await rt.admit(
                scope, prompt, params, cache_salt=salt, kv_transfer_params={DO_REMOTE_PREFILL: bool(addresses)}
            )
            first = None
            if plan.location == "remote":
                first = await self._remote_prefill(scope, request, plan, addresses)
            location = "local" if first is None else "remote"
            rt.metrics.count_prefill(location)
            log.debug(
                "request_id=%s event=prefill location=%s prompt_tokens=%d held_tokens=%d",
                rid,
                location,
                len(prompt),
                plan.held_tokens,
            )
            if first is not None:
                now = time.monotonic()
                scope.clock.tokens(1, now)
                yield decode_pb2.GenerateEvent(
                    token_ids=[first.first_token_id],
                    ttft_seconds=now - scope.started,
                    logprobs=[first.first_logprob] if first.HasField("first_logprob") else [],
                )
            while not scope.finished:
                out = await scope.next_output()  # observes the tokens and the end in vllm:* series
                scope.finished = out.finished
                yield self._event(out)

    def _event(self, out: StepOutput) -> decode_pb2.GenerateEvent:
        """One step's output as a stream event; the last one carries the finish reason and usage."""
        event = decode_pb2.GenerateEvent(
            token_ids=out.new_token_ids, logprobs=[convert.logprob_to_pb(lp) for lp in out.new_logprobs or []]
        )
        if out.finished:
            event.finish_reason = out.finish_reason or "stop"
            event.usage.CopyFrom(
                common_pb2.Usage(
                    prompt_tokens=out.num_prompt_tokens,
                    completion_tokens=out.num_output_tokens,
                    cached_tokens=out.num_cached_tokens,
                )
            )
        return event

    def _parse(self, request: decode_pb2.GenerateRequest) -> tuple[str, list[int], SamplingParams, str | None]:
        """The request's id, prompt, sampling params and cache salt; ValueError (INVALID_ARGUMENT) for
        anything out of bounds."""
        engine = self.rt.engine
        rid = convert.check_request_id(request.request_id)
        prompt = check_prompt(request.prompt_token_ids, engine.model_config.vocab_size, engine.max_model_len)
        params = convert.params_from_pb(request.params)
        if len(request.prefill_addresses) > convert.MAX_PREFILL_ADDRESSES:
            raise ValueError(f"at most {convert.MAX_PREFILL_ADDRESSES} prefill_addresses")
        if len(request.prefill_cached_tokens) > len(request.prefill_addresses):
            raise ValueError("prefill_cached_tokens has more entries than prefill_addresses")
        return rid, prompt, params, convert.cache_salt_from_pb(request)

    async def _end(self, scope: NodeRequest) -> None:
        """The one place a request leaves this node: a finished request has already left the engine;
        any other is cut off from its KV writers first, then aborted (its blocks freed)."""
        if not scope.finished:
            await self._close_session(scope)  # no writer can touch the blocks after this
            await self.rt.loop_thread.call(self.rt.engine.abort, scope.request_id)

    async def _remote_prefill(
        self, scope: NodeRequest, request: decode_pb2.GenerateRequest, plan: KvSource, addresses: list[str]
    ) -> prefill_pb2.PrefillResponse | None:
        """Try each prefill node in order until one fills the blocks this node lacks. The CacheStore
        session covers only those (the held prefix blocks are shared with other requests and never
        writable). The prefill node gets the request's own (already validated) sampling params: its
        first token is sampled exactly as this node would have sampled it. When every prefill node
        failed, the request is prefilled here instead (None) if local prefill is on, else refused."""
        rt, engine, rid = self.rt, self.rt.engine, scope.request_id
        writable = plan.block_ids[plan.held_tokens // engine.block_manager.block_size :]
        errors = []
        hints = list(request.prefill_cached_tokens)
        for i, address in enumerate(addresses):
            creds = self.cachestore.open_session(rid, writable, timeout=rt.config.transfer.kv_timeout)
            session = scope.session = self.cachestore.get_session(rid)
            assert session is not None  # opened just above
            rank_creds: list[bytes] = []
            if self.ranks.ranks:  # a tensor-parallel node: every rank receives its own KV heads
                scope.rank_sessions = True
                rank_creds = await self.ranks.open_sessions(rid, writable, rt.config.transfer.kv_timeout)
            pb = prefill_pb2.PrefillRequest(
                request_id=rid,
                prompt_token_ids=request.prompt_token_ids,
                params=request.params,
                kv_destination=creds.to_bytes(),
                compatibility=rt.compatibility,
                decode_cached_tokens=plan.held_tokens,
                kv_rank_destinations=rank_creds,
            )
            if request.HasField("cache_salt"):
                pb.cache_salt = request.cache_salt
            try:
                # the prefill node may lack what we hold (unless the router knows it holds it): send it
                if self.pulls.wanted(plan.held_tokens, hints[i] if i < len(hints) else None):
                    pb.kv_pulled = await self.pulls.pull(address, pb, plan.block_ids, rt.config.transfer.kv_timeout)
                response = await self.prefills.prefill(address, pb, timeout=rt.config.transfer.kv_timeout)
                await session.wait_complete(timeout=rt.config.transfer.kv_timeout)
                if self.ranks.ranks:
                    await self.ranks.wait_complete(rid, rt.config.transfer.kv_timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() in REFUSALS:
                    raise  # any prefill node would refuse it: the caller's error (`_end` closes the session)
                errors.append(f"{address}: {e.code().name} {e.details()}")
                log.warning("request_id=%s event=prefill_failed prefill=%s code=%s", rid, address, e.code().name)
                response = None
            except (SessionError, asyncio.TimeoutError, RankKVError) as e:
                errors.append(f"{address}: KV did not arrive ({e})")
                response = None
            await self._close_session(scope)
            if response is not None:
                await rt.loop_thread.call(
                    engine.complete_remote_prefill,
                    rid,
                    response.first_token_id,
                    convert.logprob_from_pb(response.first_logprob) if response.HasField("first_logprob") else None,
                    response.num_cached_tokens,
                )
                return response
        if self.kv_reuse and self.local_prefill_max_tokens > 0:  # every writer is fenced off: safe to free
            log.warning("request_id=%s event=prefill_local_fallback errors=%s", rid, "; ".join(errors))
            await rt.loop_thread.call(engine.prefill_locally, rid)
            return None
        raise NodeUnavailable("every prefill node failed: " + "; ".join(errors))

    async def _close_session(self, scope: NodeRequest) -> None:
        """End the request's CacheStore session and wait until no writer is inside its blocks
        (`kv_store.wait_fenced`). The record keeps the session until then: a session closed by an
        earlier, interrupted call (e.g. a cancel during its wait) is still fenced here."""
        rid, session = scope.request_id, scope.session
        self.cachestore.close_session(rid)  # no-op when already closed
        if scope.rank_sessions:  # every other rank's writers are out of its blocks first
            await self.ranks.close_sessions(rid)
            scope.rank_sessions = False
        if session is None:
            return
        self.ranks.record_received(0, self.cachestore.metrics.received_bytes())
        try:
            await kv_store.wait_fenced(session, rid)
        finally:
            if session.safe_to_reuse:
                scope.session = None
