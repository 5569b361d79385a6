"""The kv-store component: every prefill and decode pod of every serving overlay mounts one shared
claim and passes it as --kv-store (its PDSERVE_ variable), a URL the nodes accept; the router is
untouched. Validated like the other objects (kubernetes-validate), rendered offline."""

from __future__ import annotations

import pytest

from pdserve.commands.memory_args import kv_memory_options
from pdserve.cli import build_parser
from pdserve.engine.kv_store_backends import parse_store_url
from tests.deploy.test_manifests import K8S_VERSION, OVERLAYS, by_kind, render


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_node_pod_shares_the_store_claim(overlay, tmp_path, monkeypatch):
    import kubernetes_validate

    docs = render(overlay, ("kv-store",), tmp_path)
    for doc in docs:
        if doc["kind"] in ("PersistentVolumeClaim", "Deployment"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    claim = by_kind(docs, "PersistentVolumeClaim")["pdserve-kv-store"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    deployments = by_kind(docs, "Deployment")
    for role in ("prefill", "decode"):
        pod = deployments[f"pdserve-{role}"]["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "kv-store")
        assert volume["persistentVolumeClaim"]["claimName"] == "pdserve-kv-store"
        container = pod["containers"][0]
        mount = next(m for m in container["volumeMounts"] if m["name"] == "kv-store")
        url = next(e["value"] for e in container["env"] if e["name"] == "PDSERVE_KV_STORE")
        scheme, path, _ = parse_store_url(url)
        assert scheme == "file" and path == mount["mountPath"]
        monkeypatch.setenv("PDSERVE_KV_STORE", url)  # what the node's flag parser reads from the pod
        assert kv_memory_options(build_parser().parse_args([role])) == {"kv_store": url}
    router = deployments["pdserve-router"]["spec"]["template"]["spec"]
    assert all(v["name"] != "kv-store" for v in router.get("volumes", []))
