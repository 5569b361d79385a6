"""Mutual TLS between router and nodes: a cluster started with --cluster-tls-* serves requests,
and a node refuses a plaintext caller and a TLS caller without a certificate of the cluster CA."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.node_runtime.auth import cluster_metadata
from pdserve.node_runtime.cluster_tls import TLS_SERVER_NAME, ClusterTLS, make_throwaway
from pdserve.v1 import common_pb2, decode_pb2_grpc
from tests.e2e.cluster import ROOT, start_cluster, stop
from tests.e2e.router_cluster import API_KEY, free_port, start_router

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_cluster_over_mutual_tls(tmp_path, tiny_model_dir):
    pytest.importorskip("cryptography")
    cert, key, ca = make_throwaway(tmp_path)
    tls = ["--cluster-tls-cert", str(cert), "--cluster-tls-key", str(key), "--cluster-tls-ca", str(ca)]
    cluster = start_cluster(1, 1, model=str(tiny_model_dir), extra=tls)
    router = None
    try:
        router, base = start_router(cluster, str(tiny_model_dir), extra=tls)
        body = {"model": "pdserve-tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"

        address, metadata = cluster.decodes[0].address, cluster_metadata(cluster.secret)
        async with grpc.aio.insecure_channel(address) as plain:  # no TLS at all
            with pytest.raises(grpc.aio.AioRpcError):
                await decode_pb2_grpc.DecodeStub(plain).GetLoad(common_pb2.LoadRequest(), metadata=metadata, timeout=5)
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())  # TLS, but no client certificate
        options = [("grpc.ssl_target_name_override", TLS_SERVER_NAME)]
        async with grpc.aio.secure_channel(address, no_cert, options=options) as anonymous:
            with pytest.raises(grpc.aio.AioRpcError):
                await decode_pb2_grpc.DecodeStub(anonymous).GetLoad(
                    common_pb2.LoadRequest(), metadata=metadata, timeout=5
                )
        async with ClusterTLS.from_files(str(cert), str(key), str(ca)).channel(address, []) as member:
            report = await decode_pb2_grpc.DecodeStub(member).GetLoad(
                common_pb2.LoadRequest(), metadata=metadata, timeout=10
            )
            assert report.num_total_blocks > 0
    finally:
        if router is not None:
            stop(router)
        cluster.stop()


def cachestore_samples(metrics_port: int) -> dict[str, float]:
    """A node's CacheStore series from its /metrics, by name and sorted labels (less transport and model_name)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r"^(pdserve_cachestore_\w+)(?:\{([^}]*)\})? (\S+)$", text, re.M):
        labels = ",".join(
            sorted(x for x in (m[2] or "").split(",") if x and not x.startswith(("transport=", "model_name=")))
        )
        out[f"{m[1]}{{{labels}}}"] = float(m[3])
    return out


def test_up_with_a_throwaway_ca_serves_and_cleans_up():
    """`pdserve up --cluster-tls`: every node runs with the certificate, requests are served with
    their KV crossing the CacheStore link over mutual TLS (prefill -> decode), and the throwaway key
    is gone after Ctrl-C."""
    pytest.importorskip("cryptography")
    port, metrics = free_port(), free_port()  # metrics: prefill-0 on it, decode-0 on the next port
    tmp = tempfile.mkdtemp(prefix="up-tls-test-")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "pdserve.cli", "up", "--cluster-tls", "--num-decode", "1", "--port", str(port)),
            *("--local-prefill-max-tokens", "0", "--metrics-base-port", str(metrics)),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": tmp},
        start_new_session=True,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "pdserve is up" in line:
                break
        assert any("pdserve is up" in x for x in lines), "".join(lines)
        assert len(list(Path(tmp).glob("pdserve-tls-*/cluster.key"))) == 1
        body = {"model": "pdserve-tiny", "prompt": "Hi there, a prompt for the prefill node", "max_tokens": 3}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        sent, received = cachestore_samples(metrics), cachestore_samples(metrics + 1)
        assert sent["pdserve_cachestore_tls{}"] == received["pdserve_cachestore_tls{}"] == 1
        assert sent['pdserve_cachestore_bytes_total{side="send"}'] > 0
        assert received['pdserve_cachestore_bytes_total{side="recv"}'] > 0
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while list(Path(tmp).glob("pdserve-tls-*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not list(Path(tmp).glob("pdserve-tls-*"))
