"""The kv-store-mooncake component: a `mooncake_master` Deployment + Service + NetworkPolicy, and every
prefill and decode pod of every serving overlay given --kv-store mooncake://SERVICE:PORT (its PDSERVE_
variable) as a URL pdserve's own parser accepts once Kubernetes has expanded $(POD_IP) into it. The
images pin the Mooncake version these tests run against, and the installed master accepts the
manifest's flags and answers its probe path (started on 127.0.0.1). Rendered offline."""

from __future__ import annotations

import importlib.metadata
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.commands.memory_args import kv_memory_options
from pdserve.engine.kv_store_backends import MOONCAKE_OPTIONS, parse_store_url
from tests.deploy.test_manifests import K8S, K8S_VERSION, OVERLAYS, ROOT, by_kind, render

COMPONENT = "kv-store-mooncake"
MASTER = "pdserve-mooncake-master"
POD_IP = "10.1.2.3"  # what Kubernetes puts in $(POD_IP) for one pod


def _flag(args: list[str], name: str) -> str:
    """The value of `--name=VALUE` among a container's args (the form the manifest uses)."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"expected one --{name}= in {args}"
    return values[0]


def _port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def _master_container(docs: list[dict]) -> dict:
    return by_kind(docs, "Deployment")[MASTER]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nodes_point_at_the_master_service(overlay, tmp_path, monkeypatch):
    import kubernetes_validate

    docs = render(overlay, (COMPONENT,), tmp_path)
    for doc in docs:
        if doc["kind"] in ("Deployment", "Service", "NetworkPolicy"):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    deployments = by_kind(docs, "Deployment")
    master_dep = deployments[MASTER]
    assert master_dep["spec"]["replicas"] == 1 and master_dep["spec"]["strategy"]["type"] == "Recreate"
    master = _master_container(docs)
    assert master["command"] == ["mooncake_master"]
    rpc_port = int(_flag(master["args"], "rpc_port"))
    assert _flag(master["args"], "rpc_address") == "0.0.0.0"
    assert _port(master, "rpc") == rpc_port
    assert _port(master, "http") == int(_flag(master["args"], "metrics_port"))
    assert master["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"cpu", "memory"} <= set(master["resources"]["requests"])
    base_tag = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["images"][0]["newTag"]
    assert master["image"] == f"pdserve:{base_tag}"  # the CPU image, the base's tag, with every overlay

    service = by_kind(docs, "Service")[MASTER]
    assert service["spec"]["selector"] == master_dep["spec"]["template"]["metadata"]["labels"]
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == "rpc"

    node_labels = []
    for role in ("prefill", "decode"):
        dep = deployments[f"pdserve-{role}"]
        node_labels.append(dep["spec"]["template"]["metadata"]["labels"])
        env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        names = [e["name"] for e in env]
        assert names.count("PDSERVE_KV_STORE") == 1
        # $(POD_IP) is expanded only from variables defined before it in the list
        assert "POD_IP" in names[: names.index("PDSERVE_KV_STORE")]
        raw = env[names.index("PDSERVE_KV_STORE")]["value"]
        assert "$(POD_IP)" in raw
        url = raw.replace("$(POD_IP)", POD_IP)
        scheme, location, options = parse_store_url(url)
        assert scheme == "mooncake"
        assert location == f"{service['metadata']['name']}:{service_port['port']}"
        assert options["local_hostname"] == POD_IP
        assert set(options) <= MOONCAKE_OPTIONS
        monkeypatch.setenv("PDSERVE_KV_STORE", url)  # what the node's flag parser reads from the pod
        assert kv_memory_options(build_parser().parse_args([role])) == {"kv_store": url}
    router = deployments["pdserve-router"]["spec"]["template"]["spec"]["containers"][0]
    assert all(e["name"] != "PDSERVE_KV_STORE" for e in router.get("env", []))

    # only the node pods reach the master's RPC port (Mooncake Store has no authentication)
    policy = by_kind(docs, "NetworkPolicy")[MASTER]["spec"]
    assert policy["podSelector"]["matchLabels"] == master_dep["spec"]["template"]["metadata"]["labels"]
    (rule,) = policy["ingress"]
    assert [p["port"] for p in rule["ports"]] == [rpc_port]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace only
    (expr,) = peer["podSelector"]["matchExpressions"]
    assert expr["operator"] == "In" and sorted(expr["values"]) == sorted(lbl[expr["key"]] for lbl in node_labels)
    router_labels = deployments["pdserve-router"]["spec"]["template"]["metadata"]["labels"]
    assert router_labels.get(expr["key"]) not in expr["values"]


def _pin(text: str, package: str) -> str:
    """The version `package` is installed at in a Dockerfile or script (through its ARG if it uses one)."""
    match = re.search(rf'"{re.escape(package)}==([^"]+)"', text)
    assert match, f"{package} is not pinned"
    version = match.group(1)
    arg = re.fullmatch(r"\$\{(\w+)\}", version)
    if arg:
        default = re.search(rf"^ARG {arg.group(1)}=(\S+)$", text, re.M)
        assert default, f"ARG {arg.group(1)} has no default"
        version = default.group(1)
    return version


def test_images_pin_the_mooncake_version_the_tests_run_against():
    docker = ROOT / "deploy" / "docker"
    script = _pin((ROOT / "scripts" / "install_mooncake.sh").read_text(), "mooncake-transfer-engine-non-cuda")
    assert _pin((docker / "Dockerfile").read_text(), "mooncake-transfer-engine-non-cuda") == script
    assert _pin((docker / "Dockerfile.gpu").read_text(), "mooncake-transfer-engine") == script
    try:
        installed = importlib.metadata.version("mooncake-transfer-engine-non-cuda")
    except importlib.metadata.PackageNotFoundError:
        return  # no wheel here (scripts/install_mooncake.sh): the script's pin is what the tests would use
    assert installed == script


def _master_binary() -> Path | None:
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    return path if path.is_file() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(_master_binary() is None, reason="needs the mooncake wheel (scripts/install_mooncake.sh)")
def test_the_installed_master_takes_the_manifests_flags_and_answers_its_probe(tmp_path):
    """The manifest's args, with loopback addresses and free ports, start the real master, whose
    readiness path answers on the metrics port and whose RPC port accepts connections."""
    master = _master_container(render("cpu-demo", (COMPONENT,), tmp_path))
    rpc, http = _free_port(), _free_port()
    mapped = {"rpc_address": "127.0.0.1", "metrics_host": "127.0.0.1", "rpc_port": str(rpc), "metrics_port": str(http)}
    args = []
    for arg in master["args"]:
        name = arg[2:].split("=", 1)[0]
        args.append(f"--{name}={mapped[name]}" if name in mapped else arg)
    assert sum(a.startswith(("--rpc_port=", "--metrics_port=")) for a in args) == 2
    log = open(tmp_path / "master.log", "w+")
    probe = f"http://127.0.0.1:{http}{master['readinessProbe']['httpGet']['path']}"
    proc = subprocess.Popen([str(_master_binary()), *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, status = time.monotonic() + 30, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = urllib.request.urlopen(probe, timeout=1).status
                break
            except OSError:
                time.sleep(0.1)
        log.seek(0)
        assert proc.poll() is None, f"mooncake_master exited {proc.returncode}:\n{log.read()[-2000:]}"
        assert status == 200
        socket.create_connection(("127.0.0.1", rpc), 2).close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
