"""A real network partition (veth link down between two namespaces) cuts a prefill node off from
the router and the decode node with no FIN and no RST. Streams in flight on it get their first
token within --hung-after + 3 s with the exact text, and a decode node's own wait on it ends at
--peer-timeout (gRPC keepalive), not at --kv-timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.e2e import netns
from tests.e2e.cluster import READY_TIMEOUT, ROOT, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HUNG_AFTER, PEER_TIMEOUT, KV_TIMEOUT = 3.0, 3.0, 60.0
SECRET = "partition-secret"
PROMPT = "The quick brown fox jumps over the lazy dog because"


def start_in(net: netns.Partitionable, ns: str, role: str, args: list[str], env: dict | None = None) -> Proc:
    proc = Proc(
        role,
        [*net.prefix(ns), sys.executable, "-m", "pdserve.cli", role, *args],
        {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=ROOT,
        ready_prefix=f"READY {role} ",
        max_lines=None,
        echo_errors=False,
    )
    procs_started.append(proc)
    proc.wait_ready(time.monotonic() + READY_TIMEOUT)
    return proc


procs_started: list[Proc] = []


def client(net: netns.Partitionable, *args: str, on_sending=None) -> list[dict]:
    """Run tests.e2e.netns_client inside B; call `on_sending()` once its requests go out."""
    cmd = [*net.prefix(net.b), sys.executable, "-m", "tests.e2e.netns_client", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout.readline().strip() == "SENDING", p.stderr.read()
            if on_sending:
                on_sending()
            out, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def net():
    reason = netns.available()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    with netns.Partitionable() as n:
        try:
            yield n
        finally:
            for proc in procs_started:
                proc.stop()
            procs_started.clear()


def test_a_partitioned_prefill_node_costs_hung_after_not_kv_timeout(net, tiny_model_dir):
    common = ["--port", "0", "--transport", "tcp", "--cluster-secret", SECRET, "--num-threads", "1"]
    common += ["--model", str(tiny_model_dir), "--kv-timeout", str(KV_TIMEOUT), "--peer-timeout", str(PEER_TIMEOUT)]
    # every KV write of the doomed node waits, so requests are still in flight on it at the cut
    slow = {"PDSERVE_FAULT_WRITE_DELAY_RATE": "1", "PDSERVE_FAULT_WRITE_DELAY_SECONDS": "0.5"}
    doomed = start_in(net, net.a, "prefill", [*common, "--host", net.addr_a], slow)
    healthy = start_in(net, net.b, "prefill", [*common, "--host", net.addr_b])
    # never prefill locally: the repeated prompt is cached on the decode node, and the test needs
    # its prefills on the prefill nodes
    decode = start_in(net, net.b, "decode", [*common, "--host", net.addr_b, "--local-prefill-max-tokens", "0"])
    port = 8000  # namespace B is new: nothing else listens there
    router_args = ["--port", str(port), "--model", str(tiny_model_dir), "--served-model-name", "pdserve-tiny"]
    router_args += ["--cluster-secret", SECRET, "--prefill", f"{doomed.address},{healthy.address}"]
    router_args += ["--decode", decode.address, "--hung-after", str(HUNG_AFTER), "--health-timeout", "0.5"]
    start_in(net, net.b, "router", router_args)
    base = f"http://127.0.0.1:{port}"

    [reference] = client(net, "stream", base, "1", PROMPT, "8")
    assert reference["status"] == 200 and reference["text"]
    before = sum("event=prefill" in line for line in doomed.lines)

    streams = client(net, "stream", base, "4", PROMPT, "8", on_sending=lambda: (time.sleep(0.3), net.cut()))
    assert sum("event=prefill" in line for line in doomed.lines) > before, "no stream was in flight on the node"
    for s in streams:
        assert s["status"] == 200 and s["text"] == reference["text"]
        assert s["first_token_s"] < HUNG_AFTER + 3.0, streams

    # the decode node alone, told to use the partitioned node first: its keepalive ends that wait
    [direct] = client(net, "generate", decode.address, SECRET, f"{doomed.address},{healthy.address}", "4")
    assert len(direct["tokens"]) == 4
    assert direct["seconds"] < PEER_TIMEOUT + 5.0 < KV_TIMEOUT
