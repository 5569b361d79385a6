"""Render every kustomize overlay offline and validate it (no cluster exists on these machines)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
ALL_OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
# Offline batch mode: an Indexed Job of `pdserve batch --external-stages` + `pdserve stage`, none of
# the serving objects (so no serving component applies to it either).
OFFLINE = {"offline"}
OVERLAYS = [o for o in ALL_OVERLAYS if o not in OFFLINE]
"""The serving overlays (router, prefill and decode Deployments)."""
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").exists())
# Components that only make sense with some overlays (the CPU HPA scales on CPU, meaningless on GPUs;
# cpu-demo already includes it). The gateway components add only custom resources that touch no
# other object: tests/deploy/test_gateway.py renders them with every overlay, and leaving them out of
# the product keeps it from quadrupling.
ONLY_WITH = {
    "autoscaling-cpu": set(),
    "rdma-sriov": {"gpu-rdma"},
    "gateway-api": set(),
    "inference-pool": set(),
    "kv-store": set(),  # rendered with every overlay by tests/deploy/test_kv_store_component.py
    "kv-store-mooncake": set(),  # rendered with every overlay by test_kv_store_mooncake_component.py
    # replaces autoscaling-keda (the same ScaledObjects): tests/deploy/test_planner_keda_component.py
    "planner-keda": set(),
}
# Custom resources (no schema in kubernetes-validate), each checked in its own test, and the
# opt-in components that may bring them.
CUSTOM_GROUPS = {
    "monitoring.coreos.com/": {"monitoring"},
    "keda.sh/": {"autoscaling-keda", "planner-keda"},
    "gateway.networking.k8s.io/": {"gateway-api", "inference-pool"},
    "inference.networking.k8s.io/": {"inference-pool"},
}
K8S_VERSION = "1.32.0"


def _kustomize(path: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (with kustomize) is needed to render the manifests")
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def render(overlay: str, components: tuple[str, ...] = (), tmp: Path | None = None) -> list[dict]:
    """Render an overlay, optionally with components added the way a user adds them (a kustomization
    that lists the overlay as a resource and the components, in the overlay's namespace)."""
    if not components:
        return _kustomize(K8S / "overlays" / overlay)
    assert tmp is not None
    namespace = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())["namespace"]
    rel = os.path.relpath(K8S, tmp)
    (tmp / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": namespace,
                "resources": [f"{rel}/overlays/{overlay}"],
                "components": [f"{rel}/components/{c}" for c in components],
            }
        )
    )
    return _kustomize(tmp)


def combinations() -> list[tuple[str, tuple[str, ...]]]:
    out = [(overlay, ()) for overlay in ALL_OVERLAYS if overlay in OFFLINE]
    for overlay in OVERLAYS:
        built_in = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text()).get("components", [])
        allowed = [
            c
            for c in COMPONENTS
            if overlay in ONLY_WITH.get(c, {overlay}) and not any(b.endswith(f"/{c}") for b in built_in)
        ]
        for n in range(len(allowed) + 1):
            out += [(overlay, combo) for combo in itertools.combinations(allowed, n)]
    return out


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("overlay,components", combinations(), ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_every_overlay_and_component_combination_validates(overlay, components, tmp_path):
    import kubernetes_validate

    docs = render(overlay, components, tmp_path)
    for doc in docs:
        group = next((g for g in CUSTOM_GROUPS if doc["apiVersion"].startswith(g)), None)
        if group is not None:
            assert CUSTOM_GROUPS[group] & set(components), f"{doc['kind']} belongs in an opt-in component"
            continue  # custom resources: validated in test_monitoring.py / test_keda_scaled_objects
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        assert doc["metadata"].get("namespace", overlay) != "default"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_ready_for_a_fresh_cluster(overlay):
    docs = render(overlay)
    (namespace,) = by_kind(docs, "Namespace").values()
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] in ("baseline", "privileged")
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "Namespace"} == {namespace["metadata"]["name"]}
    assert not any(d["apiVersion"].startswith("monitoring.coreos.com/") for d in docs)  # base needs no operator
    for name, dep in by_kind(docs, "Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod["containers"]:
            assert c["imagePullPolicy"] == "IfNotPresent"
            assert re.fullmatch(r"[a-z0-9./-]+:\d+\.\d+\.\d+", c["image"]), c["image"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "startupProbe" in c
            if "nvidia.com/gpu" in c["resources"]["limits"]:
                assert c["resources"]["requests"] == c["resources"]["limits"], f"{name} is not Guaranteed"
            else:
                assert pod["securityContext"]["runAsNonRoot"] is True
        if name != "pdserve-router":  # a large checkpoint may take 10-60 min to load
            probe = pod["containers"][0]["startupProbe"]
            assert probe["periodSeconds"] * probe["failureThreshold"] >= 3600
    router = by_kind(docs, "Deployment")["pdserve-router"]["spec"]["template"]["spec"]
    assert router["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    config = next(iter(by_kind(docs, "ConfigMap").values()))
    assert router["terminationGracePeriodSeconds"] > 10 + float(config["data"]["PDSERVE_GRACEFUL_TIMEOUT"])
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert bool(hpas) == (overlay == "cpu-demo"), "only cpu-demo scales on CPU"


def test_every_configmap_key_is_read():
    """A ConfigMap key is either a PDSERVE_<FLAG> of a command that the pods run, or an env the code reads."""
    import argparse

    from pdserve.cli import build_parser
    from pdserve.node_runtime.config import env_name

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {
        env_name(o) for p in sub.choices.values() for a in p._actions for o in a.option_strings if o.startswith("--")
    }
    sources = "\n".join(p.read_text() for p in (ROOT / "pdserve").rglob("*.py"))
    for overlay in ALL_OVERLAYS:
        for cm in by_kind(render(overlay), "ConfigMap").values():
            for key in cm["data"]:
                assert key in flags or f'"{key}"' in sources, (
                    f"{key} in ConfigMap {cm['metadata']['name']} is never read"
                )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nodes_and_router_are_wired_for_k8s_discovery(overlay):
    docs = render(overlay)
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
        # both roles receive KV (decode from prefill, prefill from D->P pulls) on a fixed, declared port
        cachestore = int(container["args"][container["args"].index("--cachestore-port") + 1])
        assert {"name": "cachestore", "containerPort": cachestore} in container["ports"]
    router = deployments["pdserve-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["readinessProbe"]["httpGet"]["path"] == "/health"
    for role, port in (("prefill", 50061), ("decode", 50071)):
        # SRV discovery: `_grpc._tcp.<service>` needs a Service port named grpc (it supplies the port).
        assert f"_grpc._tcp.pdserve-{role}" in router["args"]
        assert {"name": "grpc", "port": port, "targetPort": "grpc"} in services[f"pdserve-{role}"]["spec"]["ports"]


def test_cpu_demo_scale_and_dev_secret():
    docs = render("cpu-demo")
    deployments = by_kind(docs, "Deployment")
    assert deployments["pdserve-decode"]["spec"]["replicas"] == 2
    assert deployments["pdserve-prefill"]["spec"]["replicas"] == 1
    assert "pdserve-secrets" in by_kind(docs, "Secret")


DASHBOARD = K8S / "components" / "monitoring" / "dashboards" / "pdserve.json"
SERIES = re.compile(r"\b(pdserve_[a-z0-9_]+|vllm:[a-z0-9_]+)")


def exported(name: str) -> bool:
    """Whether the code exports the series `name` (a family name, or one with a _total/_bucket suffix)."""
    sources = "\n".join(p.read_text() for p in (ROOT / "pdserve").rglob("*.py"))
    return f'"{re.sub(r"_(total|bucket|sum|count)$", "", name)}"' in sources


def test_dashboard_queries_exported_series():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all(SERIES.search(e) for e in exprs)
    for name in {m for e in exprs for m in SERIES.findall(e)}:  # every series read is one the code exports
        assert exported(name), f"{name} is not exported by pdserve"


def test_dashboard_ships_as_a_grafana_configmap(tmp_path):
    docs = render("cpu-demo", ("monitoring",), tmp_path)
    cm = by_kind(docs, "ConfigMap")["pdserve-grafana-dashboards"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "pdserve-demo"
    assert json.loads(cm["data"]["pdserve.json"]) == json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scaled_objects_target_real_deployments_and_exported_series(overlay, tmp_path):
    docs = render(overlay, ("autoscaling-keda",), tmp_path)
    deployments = by_kind(docs, "Deployment")
    scaled = by_kind(docs, "ScaledObject")
    assert set(scaled) == {"pdserve-decode", "pdserve-prefill"}
    if overlay == "gpu-rdma":
        assert not by_kind(docs, "HorizontalPodAutoscaler"), "gpu-rdma must not inherit a CPU HPA"
    for obj in scaled.values():
        namespace = obj["metadata"]["namespace"]
        assert namespace == deployments["pdserve-decode"]["metadata"]["namespace"]
        assert obj["spec"]["scaleTargetRef"]["name"] in deployments
        for trigger in obj["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
            # the release namespace, whatever the overlay: never a hard-coded one
            assert re.findall(r'namespace="([^"]*)"', query) == [namespace], query
            for series in SERIES.findall(query):
                assert exported(series), series


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_spread_over_nodes_and_zones_and_prefill_has_a_pdb(overlay):
    docs = render(overlay)
    for name, dep in by_kind(docs, "Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        keys = set()
        for c in pod["topologySpreadConstraints"]:
            assert c["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"], name
            keys.add(c["topologyKey"])
        assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}, name
    router = by_kind(docs, "Deployment")["pdserve-router"]["spec"]["template"]["spec"]
    (term,) = router["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {"app": "pdserve-router"}
    pdbs = {p["spec"]["selector"]["matchLabels"]["app"] for p in by_kind(docs, "PodDisruptionBudget").values()}
    assert pdbs == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}


def test_offline_overlay_is_an_indexed_pipeline_job(monkeypatch):
    """Index 0 runs the controller (`pdserve batch --external-stages`), the others `pdserve stage`;
    RANK is the completion index, the rendezvous is pod 0's name under the headless Service, and
    both command lines parse with the ConfigMap's settings (the flags exist; required ones are set)."""
    from pdserve.cli import build_parser

    docs = render("offline")
    (namespace,) = by_kind(docs, "Namespace").values()
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "Namespace"} == {namespace["metadata"]["name"]}
    assert not by_kind(docs, "Deployment"), "offline mode runs no serving objects"
    (job,) = by_kind(docs, "Job").values()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    world = int(env["WORLD_SIZE"]["value"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == world >= 2
    assert spec["suspend"] is True  # started once the input is on the volume
    assert (
        env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    svc = by_kind(docs, "Service")[pod["subdomain"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert env["MASTER_ADDR"]["value"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert int(env["MASTER_PORT"]["value"]) in {p["port"] for p in svc["spec"]["ports"]}

    pvc = next(iter(by_kind(docs, "PersistentVolumeClaim")))
    volumes = {v["name"]: v for v in pod["volumes"]}
    data = next(m for m in c["volumeMounts"] if volumes[m["name"]].get("persistentVolumeClaim"))
    assert volumes[data["name"]]["persistentVolumeClaim"]["claimName"] == pvc
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for container in pod["containers"] + pod.get("initContainers", []):
        assert container["imagePullPolicy"] == "IfNotPresent"
        assert re.fullmatch(r"[a-z0-9./-]+:\d+\.\d+\.\d+", container["image"]), container["image"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert container["resources"]["requests"] and container["resources"]["limits"]

    script = c["args"][0]
    commands = re.findall(r"exec pdserve (.+)", script)
    assert len(commands) == 2 and 'if [ "$RANK" = 0 ]' in script
    batch, stage = (cmd.split() for cmd in commands)
    assert batch[0] == "batch" and "--external-stages" in batch and "--resume" in batch and stage[0] == "stage"
    for flag in ("-i", "-o", "--stats"):
        assert batch[batch.index(flag) + 1].startswith(data["mountPath"] + "/")
    (config,) = by_kind(docs, "ConfigMap").values()
    for key in [k for k in os.environ if k.startswith("PDSERVE_")]:
        monkeypatch.delenv(key)
    for key, value in config["data"].items():
        monkeypatch.setenv(key, value)
    parser = build_parser()
    assert parser.parse_args(batch).external_stages
    args = parser.parse_args(stage)
    assert args.model_dir == config["data"]["PDSERVE_MODEL"]  # the stages load what the controller reads
    assert args.num_kv_blocks == int(config["data"]["PDSERVE_NUM_KV_BLOCKS"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cluster_tls_component_takes_the_certificates_from_a_secret(overlay, tmp_path, monkeypatch):
    """Every serving process mounts the Secret pdserve-cluster-tls read-only, and its
    PDSERVE_CLUSTER_TLS_* variables name the Secret's files and parse as the --cluster-tls-* flags
    (which cover gRPC and the CacheStore links)."""
    from pdserve.cli import build_parser

    docs = render(overlay, ("cluster-tls",), tmp_path)
    for key in [k for k in os.environ if k.startswith("PDSERVE_")]:
        monkeypatch.delenv(key)
    for role in ("router", "prefill", "decode"):
        pod = by_kind(docs, "Deployment")[f"pdserve-{role}"]["spec"]["template"]["spec"]
        (secret,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "pdserve-cluster-tls"]
        assert secret["secret"]["defaultMode"] == 0o400
        c = pod["containers"][0]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == secret["name"]]
        assert mount["readOnly"] is True
        env = {e["name"]: e["value"] for e in c["env"] if e["name"].startswith("PDSERVE_CLUSTER_TLS_")}
        files = {"CERT": "tls.crt", "KEY": "tls.key", "CA": "ca.crt"}
        assert env == {f"PDSERVE_CLUSTER_TLS_{k}": f"{mount['mountPath']}/{f}" for k, f in files.items()}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert c["args"][0] == role
        args = build_parser().parse_args(c["args"])
        assert (args.cluster_tls_cert, args.cluster_tls_key, args.cluster_tls_ca) == tuple(
            env[f"PDSERVE_CLUSTER_TLS_{k}"] for k in files
        )
