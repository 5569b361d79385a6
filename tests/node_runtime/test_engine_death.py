"""A dead engine thread is a failure: callers and subscribers get errors, health says NOT_SERVING, the
process exits non-zero. Also: a node without a cluster secret warns that every peer is trusted."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import pytest
from grpc_health.v1 import health_pb2

from pdserve.engine.config import EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_runtime.engine_loop import EngineDeadError
from pdserve.node_runtime.grpc_errors import NodeUnavailable
from pdserve.node_runtime.node import NodeRuntime
from pdserve.node_runtime.node_config import NodeConfig
from tests.e2e.cluster import ROOT


def broken_step(self):
    raise RuntimeError("injected step failure")


async def ended(record) -> None:
    """A request's end callback with nothing to release (these requests hold no transfer)."""


async def test_engine_death_fails_waiters_and_reports_not_serving(tiny_model_dir, monkeypatch, caplog):
    rt = NodeRuntime("decode", NodeConfig(EngineConfig(tiny_model_dir, num_kv_blocks=64)))
    with caplog.at_level(logging.WARNING, logger="pdserve.node"):
        await rt.start(lambda server: None)
    assert any("every gRPC and CacheStore peer" in r.getMessage() for r in caplog.records)
    try:
        monkeypatch.setattr(type(rt.engine), "step", broken_step)
        async with rt.request("r1", ended) as scope:
            await rt.admit(scope, [1, 2, 3], SamplingParams(max_tokens=4))
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(scope.next_output(), 30)  # an error finish, not a hang
        await asyncio.wait_for(rt.failed.wait(), 5)
        with pytest.raises(EngineDeadError):
            await rt.loop_thread.call(rt.engine.load)
        with pytest.raises(NodeUnavailable):  # a dead node admits nothing more
            async with rt.request("r2", ended):
                pass
        for _ in range(50):  # the health update is scheduled on the loop
            status = await rt.health.Check(health_pb2.HealthCheckRequest(), None)
            if status.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.05)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        await rt.stop()


CHILD = """
import sys
import pdserve.engine.llm_engine as m
def step(self):
    raise RuntimeError("injected step failure")
m.LLMEngine.step = step
from pdserve.cli import main
sys.exit(main())
"""


def test_node_process_exits_nonzero_when_its_engine_dies(tiny_model_dir):
    """A colocated decode node with a broken step: the request fails fast with UNAVAILABLE and the
    process exits 1."""
    import grpc

    from tests.e2e.grpc_client import generate, greedy

    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            "decode",
            "--port",
            "0",
            "--colocated",
            "--model",
            str(tiny_model_dir),
            "--num-kv-blocks",
            "64",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_SECRET"},
    )
    try:
        address = None
        for line in proc.stdout:
            if line.startswith("READY decode "):
                address = line.split()[-1]
                break
        assert address, "decode node never became ready"
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            asyncio.run(asyncio.wait_for(generate(address, "", "r1", [1, 2, 3], greedy(4), []), 60))
        # UNAVAILABLE (not UNKNOWN): the router counts it against the node and retries elsewhere
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine thread" in failed.value.details()
        assert proc.wait(60) == 1
        assert "engine thread died" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
