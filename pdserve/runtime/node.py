"""NodeRuntime: what prefill and decode nodes share — engine thread, gRPC server, health, metrics, drain."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from pdserve.runtime.auth import SecretInterceptor
from pdserve.runtime.convert import compatibility
from pdserve.runtime.engine_loop import EngineLoop
from pdserve.runtime.node_metrics import NodeMetrics, served_model_name
from pdserve.v1 import common_pb2

log = logging.getLogger("pdserve.node")
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class NodeOptions:
    """Process-level options of a node (the engine's own live in EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    cluster_secret: str = ""
    transport: str = "tcp"
    drain_timeout: float = 30.0
    kv_timeout: float = 60.0
    """Seconds a KV transfer / session may take."""


class NodeRuntime:
    """Owns the engine thread and the grpc.aio server of one node process."""

    def __init__(self, role: str, engine_config: EngineConfig, options: NodeOptions) -> None:
        self.role = role
        self.options = options
        self.engine = LLMEngine(engine_config)
        self.compatibility = compatibility(self.engine)
        self.metrics = NodeMetrics(role, served_model_name(engine_config.model_dir),
                                   transport_requested=options.transport)
        self.draining = False
        self.inflight = 0
        self.loop_thread: EngineLoop | None = None
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.address = ""
        self.node_id = ""
        self.failed: asyncio.Event | None = None
        """Set when the engine thread has died: the process must exit non-zero (see node_common.serve)."""

    async def start(self, register_services) -> str:
        if not self.options.cluster_secret:
            log.warning("no cluster secret (--cluster-secret / $PDSERVE_CLUSTER_SECRET): every gRPC and CacheStore "
                        "peer that can reach this node is trusted; set one outside local development")
        self.failed = asyncio.Event()
        self.loop_thread = EngineLoop(self.engine, asyncio.get_running_loop(), on_death=self._engine_died)
        self.loop_thread.start()
        self.server = grpc.aio.server(
            interceptors=[SecretInterceptor(self.options.cluster_secret)],
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        register_services(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        port = self.server.add_insecure_port(f"{self.options.host}:{self.options.port}")
        await self.server.start()
        self.address = f"{self.options.host}:{port}"
        self.node_id = f"{self.role}@{self.address}#{int(time.time() * 1000) % 10**9}"
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.metrics.serve(self.options.host, self.options.metrics_port)
        return self.address

    def _engine_died(self, error: BaseException) -> None:
        """In the event loop: stop looking healthy at once, then let the process exit non-zero."""
        log.critical("engine thread died (%r): reporting NOT_SERVING and exiting", error)
        self.draining = True
        asyncio.ensure_future(self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING))
        self.failed.set()

    async def load_report(self) -> common_pb2.LoadReport:
        load = await self.loop_thread.call(self.engine.load)
        self.metrics.observe_load(load)
        return common_pb2.LoadReport(
            role=self.role, node_id=self.node_id, num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks, num_running=load.num_running, num_waiting=load.num_waiting,
            num_queued_prefill_tokens=load.num_queued_prefill_tokens, compatibility=self.compatibility,
            block_size=self.engine.runner.kv_pool.block_size, draining=self.draining,
            max_model_len=self.engine.max_model_len)

    async def drain_and_stop(self) -> None:
        """Stop admitting, let in-flight requests finish for up to drain_timeout, then stop."""
        self.draining = True
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.options.drain_timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.inflight:
            log.warning("drain timeout: aborting %d in-flight requests", self.inflight)
        await self.stop()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.loop_thread is not None:
            self.loop_thread.stop()
