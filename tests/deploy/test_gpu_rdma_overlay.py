"""The gpu-rdma overlay: GPU and RDMA resources per tensor-parallel rank, the shared model volume with
the Job that fills it, and its host-network / SR-IOV variant. That its node commands serve together
is test_overlay_nodes.py's."""

from __future__ import annotations

from tests.deploy.test_manifests import by_kind, render

GPU_RDMA_TP = {"prefill": 1, "decode": 2}
"""The gpu-rdma overlay's tensor-parallel degrees: the prefill rank writes head slices into the decode
ranks (test_overlay_nodes.py starts these commands and sends a request across the split)."""


def test_gpu_rdma_requests_devices_and_ipc_lock():
    docs = render("gpu-rdma")
    for role, tp in GPU_RDMA_TP.items():
        spec = by_kind(docs, "Deployment")[f"pdserve-{role}"]["spec"]["template"]["spec"]
        c = spec["containers"][0]
        # one pod is one node: its N ranks, each with one GPU and one RDMA device
        assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == str(tp)
        assert c["args"].count("--tensor-parallel-size") == 1 and len(spec["containers"]) == 1
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == tp
        assert c["resources"]["requests"] == c["resources"]["limits"]
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert c["args"][c["args"].index("--transport") + 1] == "rdma"
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in spec["volumes"])


def test_gpu_rdma_model_volume_and_fill_job():
    docs = render("gpu-rdma")
    pvc = by_kind(docs, "PersistentVolumeClaim")["pdserve-models"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # read on every GPU host at once
    job = by_kind(docs, "Job")["pdserve-model-fill"]["spec"]["template"]["spec"]
    assert job["volumes"][0]["persistentVolumeClaim"] == {"claimName": "pdserve-models"}
    fill = job["containers"][0]
    assert not fill["volumeMounts"][0].get("readOnly") and "MODEL_SOURCE" in {e["name"] for e in fill["env"]}
    assert "mv /models/model.partial /models/model" in fill["args"][0]  # atomic: never a half checkpoint
    for role in ("prefill", "decode", "router"):
        args = by_kind(docs, "Deployment")[f"pdserve-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--model") + 1] == "/models/model"


def test_network_host_and_rdma_sriov_components(tmp_path):
    docs = render("gpu-rdma", ("network-host", "rdma-sriov"), tmp_path)
    for role in ("prefill", "decode"):
        pod = by_kind(docs, "Deployment")[f"pdserve-{role}"]["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        limits = pod["containers"][0]["resources"]["limits"]
        assert "rdma/hca_shared_devices_a" not in limits and limits["nvidia.com/sriov_rdma_vf"] == GPU_RDMA_TP[role]
        assert pod["containers"][0]["resources"]["requests"] == limits
    router = by_kind(docs, "Deployment")["pdserve-router"]["spec"]["template"]["spec"]
    assert "hostNetwork" not in router
