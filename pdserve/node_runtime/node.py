"""NodeRuntime: what prefill and decode nodes share — engine thread, gRPC server, health, metrics, drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.engine.kv_connector import NO_CONNECTOR, KvConnector, KvSource
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_runtime import cluster_tls, keepalive
from pdserve.node_runtime.auth import SecretInterceptor
from pdserve.node_runtime.engine_loop import EngineLoop
from pdserve.node_runtime.grpc_errors import ErrorInterceptor, NodeUnavailable
from pdserve.node_runtime.node_config import NodeConfig
from pdserve.node_runtime.node_metrics import NodeMetrics, served_model_name
from pdserve.node_runtime.node_request import NodeRequest, NodeRequests
from pdserve.node_runtime.tier_metrics import TierCollector, store_collector
from pdserve.v1 import common_pb2

log = logging.getLogger("pdserve.node")
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class NodeRuntime:
    """Owns the engine thread and the grpc.aio server of one node process."""

    def __init__(self, role: str, config: NodeConfig, connector: KvConnector = NO_CONNECTOR) -> None:
        self.role = role
        self.config = config
        self.engine = LLMEngine(config.engine, connector=connector, on_scheduled=self._scheduled)
        self.compatibility = self.engine.kv_compatibility
        names = config.node.served_model_name
        self.metrics = NodeMetrics(
            role,
            names[0] if names else served_model_name(config.engine.model_dir),
            transport_requested=config.transfer.transport,
            max_model_len=self.engine.max_model_len,
        )
        self.metrics.watch_engine(self._engine_state, self._cache_info())
        if self.engine.tier is not None:
            TierCollector(self.engine.tier.stats, role, self.metrics.model_name, self.metrics.registry)
        if self.engine.store is not None:
            store_collector(self.engine.store.stats, role, self.metrics.model_name, self.metrics.registry)
        self.draining = False
        self.requests = NodeRequests()
        """Every request on this node, by id: its one record and one cleanup path (`request`)."""
        self._loop_thread: EngineLoop | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.address = ""
        self.node_id = ""
        self.stopped = False
        """Set when the node stops: open KvEvents streams end."""
        self.failed = asyncio.Event()
        """Set when the engine thread has died: the process must exit non-zero (see node_common.serve)."""

    async def start(self, register_services) -> str:
        if not self.config.node.cluster_secret:
            log.warning(
                "no cluster secret (--cluster-secret / $PDSERVE_CLUSTER_SECRET): every gRPC and CacheStore "
                "peer that can reach this node is trusted; set one outside local development"
            )
        self.failed = asyncio.Event()
        self.tls = self.config.node.tls()
        self._loop_thread = EngineLoop(
            self.engine, asyncio.get_running_loop(), self.requests, on_death=self._engine_died
        )
        self._loop_thread.start()
        self.server = grpc.aio.server(
            interceptors=[SecretInterceptor(self.config.node.cluster_secret), ErrorInterceptor()],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                *keepalive.server_options(self.config.transfer.peer_timeout),
            ],
        )
        register_services(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        port = cluster_tls.add_port(self.server, f"{self.config.node.host}:{self.config.node.port}", self.tls)
        self.address = f"{self.config.node.host}:{port}"
        # set before serving: every KvEvents stream and load report names this incarnation
        self.node_id = f"{self.role}@{self.address}#{int(time.time() * 1000) % 10**9}"
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.metrics.serve(self.config.node.host, self.config.node.metrics_port)
        return self.address

    def _scheduled(self) -> None:
        """Engine thread, in every step once its batch is scheduled: publish the load then."""
        if self._loop_thread is not None:
            self._loop_thread.publish_load()

    @property
    def loop_thread(self) -> EngineLoop:
        """The engine thread (start() starts it)."""
        if self._loop_thread is None:
            raise RuntimeError("the node is not started")
        return self._loop_thread

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a structured-output request's grammar in a worker thread, never in the engine
        thread (a schema can take longer than many steps); admission then finds it in the engine's
        cache. ValueError (INVALID_ARGUMENT) for an invalid spec or a node without xgrammar."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.grammars.compile, params.structured_outputs)

    def _engine_died(self, error: BaseException) -> None:
        """In the event loop: stop looking healthy at once, then let the process exit non-zero."""
        log.critical("engine thread died (%r): reporting NOT_SERVING and exiting", error)
        self.draining = True
        asyncio.ensure_future(self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
        self.failed.set()

    @property
    def inflight(self) -> int:
        """Requests on this node whose RPC has not ended yet (their blocks may still be held)."""
        return len(self.requests)

    @contextlib.asynccontextmanager
    async def request(
        self,
        request_id: str,
        end: Callable[[NodeRequest], Awaitable[None]],
        prompt_tokens: int = 0,
        max_tokens: int | None = None,
        **log_fields: object,
    ) -> AsyncIterator[NodeRequest]:
        """Admit one (already validated) request for the duration of the block: refuse it while
        draining or while another request with its id is in flight here, register its record (its
        outputs queue up there) and log its admission and end.

        However the block ends (result, error, cancelled stream), `end(record)` runs exactly once,
        shielded from the cancellation, and only then does the record leave the registry, so a
        drain waits for its blocks to be freed."""
        if self.draining:
            raise NodeUnavailable(f"{self.role} node is draining")
        clock = self.metrics.requests.clock(prompt_tokens, max_tokens=max_tokens)
        record = NodeRequest(request_id, self.loop_thread.subscription(), clock, self.metrics)
        self.requests.add(record)  # ValueError for an id in flight: nothing registered, nothing to end
        fields = {k: v for k, v in log_fields.items() if k == "event"} | {"prompt_tokens": prompt_tokens} | log_fields
        log.info("request_id=%s %s", request_id, " ".join(f"{k}={v}" for k, v in fields.items()))
        try:
            yield record
        finally:
            record.ending = True
            await asyncio.shield(asyncio.ensure_future(self._end(record, end)))

    async def admit(self, record: NodeRequest, prompt: list[int], params: SamplingParams, **kwargs: Any) -> KvSource:
        """`LLMEngine.add_request` for the record's request, in the engine thread; the record keeps
        the engine's `Request` (its status) from then on."""

        def add() -> tuple[KvSource, Any]:
            source = self.engine.add_request(record.request_id, prompt, params, **kwargs)
            return source, self.engine.requests.get(record.request_id)

        source, record.engine_request = await self.loop_thread.call(add)
        return source

    async def _end(self, record: NodeRequest, end: Callable[[NodeRequest], Awaitable[None]]) -> None:
        try:
            log.info(
                "request_id=%s event=%s status=%s after_s=%.3f",
                record.request_id,
                "finish" if record.finished else "abort",
                record.status.name,
                record.age,
            )
            await end(record)
        finally:
            record.clock.finish("abort")  # no-op when its last output already ended it
            self.requests.remove(record)

    def _engine_state(self) -> tuple[object, int]:
        """(last load snapshot, preemptions so far), read by a scrape on the metrics server's thread."""
        return (self._loop_thread.load if self._loop_thread else None), self.engine.scheduler.num_preemptions

    def _cache_info(self) -> dict[str, str]:
        """vllm:cache_config_info's labels: vLLM's CacheConfig fields this engine has."""
        cfg = self.engine.config
        return {
            "engine": "0",
            "block_size": str(self.engine.kv_pool.block_size),
            "num_gpu_blocks": str(self.engine.block_manager.num_blocks),
            "num_cpu_blocks": "None",
            "cache_dtype": str(self.engine.runner.dtype).removeprefix("torch."),
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "gpu_memory_utilization": str(cfg.gpu_memory_utilization),
        }

    async def load_report(self) -> common_pb2.LoadReport:
        """The router's probe. Answered from the load the engine thread last published, never by a
        call into that thread: queued behind a long prefill step, such a call made a busy node miss
        its probes until the router declared it hung (issue 54). The engine's liveness travels
        with it: the layers it has computed and how long it has been stuck in one step."""
        load = self.loop_thread.load
        self.metrics.observe_load(load)
        return common_pb2.LoadReport(
            role=self.role,
            node_id=self.node_id,
            **load._asdict(),  # EngineLoad's fields are named as the report's
            compatibility=self.compatibility,
            block_size=self.engine.kv_pool.block_size,
            draining=self.draining,
            max_model_len=self.engine.max_model_len,
            progress=self.engine.progress,
            engine_stalled_seconds=self.loop_thread.stalled_seconds(),
        )

    async def drain_and_stop(self) -> None:
        """Stop admitting, let in-flight requests finish for up to drain_timeout, then stop."""
        await self.stop(drain=True)

    async def stop(self, drain: bool = False) -> None:
        """Stop the gRPC server and the engine thread; with `drain`, first stop admitting and let
        in-flight requests finish for up to drain_timeout."""
        if drain:
            await self._drain()
        self.stopped = True
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self._loop_thread is not None:
            self._loop_thread.stop()
        self.engine.close()  # the other tensor-parallel ranks stop with the node

    async def _drain(self) -> None:
        self.draining = True
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.config.node.drain_timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("drain timeout: aborting %d in-flight requests", self.inflight)


class Node(Protocol):
    """What `pdserve prefill|decode` runs (`node_common.serve`): a servicer around a NodeRuntime."""

    rt: NodeRuntime

    async def start(self) -> str:
        """Start serving; returns the gRPC address."""

    def discovery_meta(self) -> dict[str, str]:
        """What this node adds to its discovery registration (beyond node id and metrics port)."""

    async def stop(self, drain: bool = False) -> None:
        """Stop serving (draining in-flight requests first when asked) and release what the node holds."""
