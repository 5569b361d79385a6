"""Render every kustomize overlay offline and validate it (no cluster exists on these machines)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ["cpu-demo", "gpu-rdma"]
K8S_VERSION = "1.32.0"


def render(overlay: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with kustomize) is needed to render the manifests")
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy" / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    import kubernetes_validate
    docs = render(overlay)
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            # a CRD without a published schema: check its structure ourselves
            assert doc["kind"] == "ServiceMonitor" and doc["spec"]["endpoints"] and doc["spec"]["selector"]
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    services = by_kind(docs, "Service")
    for role, port in (("prefill", 50061), ("decode", 50071)):
        svc = services[f"pdserve-{role}"]
        assert svc["spec"]["clusterIP"] == "None"  # headless: k8s DNS discovery
        container = deployments[f"pdserve-{role}"]["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["grpc"]["port"] == port
        assert container["args"][0] == role and str(port) in container["args"]
        assert any(e["name"] == "POD_IP" for e in container["env"])
        secret_env = next(e for e in container["env"] if e["name"] == "PDSERVE_CLUSTER_SECRET")
        assert secret_env["valueFrom"]["secretKeyRef"]["name"] == "pdserve-secrets"
    router = deployments["pdserve-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "pdserve-prefill:50061" in router["args"] and "pdserve-decode:50071" in router["args"]


def test_gpu_rdma_requests_devices_and_ipc_lock():
    docs = render("gpu-rdma")
    for role in ("prefill", "decode"):
        spec = by_kind(docs, "Deployment")[f"pdserve-{role}"]["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == 1
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert c["args"][c["args"].index("--transport") + 1] == "rdma"
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in spec["volumes"])


def test_cpu_demo_scale_and_dev_secret():
    docs = render("cpu-demo")
    deployments = by_kind(docs, "Deployment")
    assert deployments["pdserve-decode"]["spec"]["replicas"] == 2
    assert deployments["pdserve-prefill"]["spec"]["replicas"] == 1
    assert "pdserve-secrets" in by_kind(docs, "Secret")


def test_dashboard_queries_pdserve_metrics():
    dash = json.loads((ROOT / "deploy" / "grafana" / "pdserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all(re.search(r"\bpdserve_[a-z0-9_]+", e) for e in exprs)
    names = {m for e in exprs for m in re.findall(r"\bpdserve_[a-z0-9_]+", e)}
    # every series the dashboard reads is one the code exports
    sources = "\n".join(p.read_text() for d in ("engine", "cachestore", "router", "pdserve") for p in (ROOT / d).rglob("*.py"))
    for name in names:
        base = re.sub(r"_(total|bucket)$", "", name)
        assert f'"{base}"' in sources, f"{name} is not exported by pdserve"
