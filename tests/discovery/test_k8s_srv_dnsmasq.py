"""k8s discovery's SRV lookups against a real DNS server: dnsmasq in a private network namespace.

The namespace (`unshare --net --mount`) has only its own loopback; /etc/resolv.conf is
bind-mounted there to point at the dnsmasq it starts, so dnspython and glibc resolve through
a real server exactly as in a pod, and nothing leaves the namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DNSMASQ = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if os.path.exists("/usr/sbin/dnsmasq") else None)

# What the namespace runs: resolve the Service the way the router does, print members as JSON.
PROBE = textwrap.dedent("""
    import asyncio, json
    from pdserve.node_runtime.discovery.k8s import K8sDnsDiscovery

    async def main():
        d = K8sDnsDiscovery({"decode": "pdserve-decode",
                             "prefill": "_metrics._tcp.pdserve-prefill.pd.svc.cluster.local",
                             "missing": "pdserve-none"})
        await d.refresh()
        print(json.dumps({r: sorted([m.host, m.port] for m in d.members(r)) for r in ("decode", "prefill", "missing")}))

    asyncio.run(main())
""")


def _skip_reason() -> str | None:
    if DNSMASQ is None:
        return "dnsmasq is not installed (scripts/install_ops_tools.sh installs it)"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    if subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True).returncode != 0:
        return "unshare --net --mount is not permitted here (needs root or user namespaces)"
    return None


def test_srv_records_give_members_and_ports(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    (tmp_path / "resolv.conf").write_text(
        "nameserver 127.0.0.1\nsearch pd.svc.cluster.local svc.cluster.local\noptions ndots:5 timeout:2 attempts:2\n"
    )
    (tmp_path / "probe.py").write_text(PROBE)
    zone = "pd.svc.cluster.local"
    dnsmasq = [
        DNSMASQ,
        "--keep-in-foreground",
        "--no-resolv",
        "--no-hosts",
        "--listen-address=127.0.0.1",
        "--bind-interfaces",
        "--port=53",
        "--local=/cluster.local/",
        f"--pid-file={tmp_path}/dnsmasq.pid",
        "--user=root",
        f"--host-record=d-0.pdserve-decode.{zone},127.0.0.2",
        f"--host-record=d-1.pdserve-decode.{zone},127.0.0.3",
        f"--host-record=p-0.pdserve-prefill.{zone},127.0.0.4",
        f"--srv-host=_grpc._tcp.pdserve-decode.{zone},d-0.pdserve-decode.{zone},50071",
        f"--srv-host=_grpc._tcp.pdserve-decode.{zone},d-1.pdserve-decode.{zone},50072",
        f"--srv-host=_metrics._tcp.pdserve-prefill.{zone},p-0.pdserve-prefill.{zone},9100",
    ]
    script = (
        f"set -e; ip link set lo up; mount --bind {tmp_path}/resolv.conf /etc/resolv.conf; "
        f"{' '.join(dnsmasq)} & DNS=$!; "
        f"for i in $(seq 50); do [ -s {tmp_path}/dnsmasq.pid ] && break; sleep 0.1; done; "
        f"{sys.executable} {tmp_path}/probe.py; kill $DNS"
    )
    out = subprocess.run(
        ["unshare", "--net", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    members = json.loads(out.stdout.strip().splitlines()[-1])
    # SRV gives each pod its own port; the short name resolves through the search domains.
    assert members["decode"] == [["127.0.0.2", 50071], ["127.0.0.3", 50072]]
    assert members["prefill"] == [["127.0.0.4", 9100]]
    assert members["missing"] == []  # NXDOMAIN: logged, nothing known yet, no crash
    assert "cannot resolve pdserve-none" in out.stderr
