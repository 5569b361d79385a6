"""Every shipped serving overlay's node commands start and serve together (issue 53: a shipped
configuration must never be one the nodes refuse). The prefill and decode Deployments' args, as
kustomize renders them, run on CPU with the device flags mapped there: `--device cuda` becomes
`--device cpu` with $PDSERVE_EMULATE_DEVICE_POOL=1 (the KV pools take every device-pool path: staging,
the GPUDirect choice, head-sliced writes from a device pool), `--transport rdma` runs on the emulated
verbs device, the model is the built-in tiny one and addresses are loopback. A request long enough to
go to the prefill node must come back with the one-process engine's tokens."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from pdserve.cachestore.geometry import EMULATE_DEVICE_ENV
from pdserve.cachestore.rdma import EMULATOR_ENV
from pdserve.engine import LLM, SamplingParams
from tests.deploy.test_manifests import OVERLAYS, by_kind, render
from tests.e2e.cluster import start, stop
from tests.e2e.grpc_client import generate, greedy
from tests.e2e.router_cluster import free_port

pytestmark = pytest.mark.slow
SECRET = "overlay-secret"


def node_command(deployment: dict, model: str, metrics_port: int) -> tuple[list[str], dict[str, str]]:
    """The container's args and environment, mapped to this machine (see the module docstring)."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = list(container["args"][1:])  # [0] is the role
    mapped = {
        "--host": "127.0.0.1",
        "--port": "0",
        "--cachestore-port": "0",
        "--metrics-port": str(metrics_port),
        "--model": model,
        "--device": "cpu",
    }
    for i, arg in enumerate(args[:-1]):
        if arg in mapped:
            args[i + 1] = mapped[arg]
    for flag in ("--model", "--metrics-port"):
        if flag not in args:
            args += [flag, mapped[flag]]
    args += ["--num-threads", "1"]  # a node per core at most here
    env = {"PDSERVE_CLUSTER_SECRET": SECRET}
    if "--device" in container["args"] and container["args"][container["args"].index("--device") + 1] != "cpu":
        env[EMULATE_DEVICE_ENV] = "1"
    if "rdma" in container["args"]:
        env[EMULATOR_ENV] = "1"
    return args, env


def remote_prefills(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("pdserve_prefill_decisions_total") and "remote" in ln]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


@pytest.mark.parametrize("overlay", OVERLAYS)
async def test_the_overlays_node_commands_serve_a_request_across_the_split(overlay, tiny_model_dir, tmp_path):
    deployments = by_kind(render(overlay), "Deployment")
    model = str(tiny_model_dir)
    prompt = [5 + (i * 7) % 200 for i in range(100)]  # past --local-prefill-max-tokens: prefilled remotely
    expected = LLM(model).generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    procs = []
    try:
        ports = {role: free_port() for role in ("prefill", "decode")}
        for role in ("prefill", "decode"):
            args, env = node_command(deployments[f"pdserve-{role}"], model, ports[role])
            procs.append(start(role, args, {**env, "PDSERVE_CACHE_DIR": str(tmp_path)}))
        prefill, decode = procs
        tokens, events = await generate(
            decode.address, SECRET, "overlay", prompt, greedy(6, ignore_eos=True), [prefill.address], timeout=120
        )
        assert tokens == expected[0].outputs[0].token_ids, overlay
        assert events[-1].finish_reason == "length"
        assert await asyncio.to_thread(remote_prefills, ports["decode"]) == 1.0  # it crossed the split
    finally:
        for p in procs:
            stop(p)
