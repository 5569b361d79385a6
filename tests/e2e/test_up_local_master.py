"""`pdserve up --kv-store mooncake://local` starts a Mooncake master for its nodes, the nodes write
their KV there, the router hears of it as store blocks, and Ctrl-C stops the master with the cluster."""

from __future__ import annotations

import re
import signal
import socket
import time

import httpx
import pytest

from pdserve.engine.kv_store_backends import parse_store_url
from tests.e2e.router_cluster import free_port
from tests.e2e.up_process import start_up

mooncake = pytest.importorskip("mooncake.store", reason="scripts/install_mooncake.sh installs Mooncake Store")

PROMPT = "Tell me everything about the long history of distributed caches, " * 6


def sample(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
        return True
    except OSError:
        return False


def test_a_node_refuses_mooncake_local():
    with pytest.raises(ValueError, match="only `pdserve up` starts a master"):
        parse_store_url("mooncake://local")


def test_the_local_master_starts_on_loopback_and_stops():
    from pdserve.commands.local_master import LocalMaster, wants_local_master

    assert wants_local_master("mooncake://local?segment=64MiB") and not wants_local_master("mooncake://h:1")
    master = LocalMaster("mooncake://local?segment=64MiB")
    master.start()
    try:
        assert listening(master.port) and master.url == f"mooncake://127.0.0.1:{master.port}?segment=64MiB"
        parse_store_url(master.url)  # what the nodes are given is a URL they take
    finally:
        master.stop()
    assert master.process is not None and master.process.poll() is not None


@pytest.mark.e2e
@pytest.mark.slow
def test_up_runs_its_own_master_and_the_router_hears_of_the_store():
    port, metrics = free_port(), free_port()
    args = ["--port", str(port), "--num-prefill", "0", "--num-decode", "1", "--metrics-base-port", str(metrics)]
    up = start_up([*args, "--kv-store", "mooncake://local?segment=64MiB&buffer=16MiB"])
    try:
        assert up.wait_up(), "\n".join(up.lines[-40:])
        url = next(line for line in up.lines if "Mooncake master for this cluster" in line).split()[-1]
        master_port = int(url.split(":")[-1].split("?")[0])
        body = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the node's writer, then its event stream, run behind the answer
            node = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
            router = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            stored = sample(node, "pdserve_kv_store_blocks_total", 'op="stored"')
            heard = sample(router, "pdserve_router_kv_tier_index_entries", 'medium="store"')
            if stored > 0 and heard > 0:
                break
            time.sleep(0.5)
        assert stored > 0 and heard > 0, (stored, heard)
    finally:
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0, "\n".join(up.lines[-40:])
    assert not listening(master_port)  # the master went with the cluster
