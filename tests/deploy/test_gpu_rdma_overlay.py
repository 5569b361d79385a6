"""The gpu-rdma overlay: GPU and RDMA resources per tensor-parallel rank, a TP pairing the CacheStore
can serve over RDMA from a CUDA pool, the shared model volume with the Job that fills it, and its
host-network / SR-IOV variant."""

from __future__ import annotations

from tests.deploy.test_manifests import by_kind, render

GPU_RDMA_TP = {"prefill": 2, "decode": 2}
"""The gpu-rdma overlay's tensor-parallel degrees. Equal on both sides: a prefill of another degree
writes KV head slices, which the CacheStore refuses over RDMA from a CUDA pool (issue 53), so an
overlay with unequal degrees could never serve (test_gpu_rdma_pairs_what_the_cachestore_takes)."""


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


def test_gpu_rdma_pairs_what_the_cachestore_takes():
    """What the shipped overlay asks for, the CacheStore client accepts: every prefill rank writes
    whole blocks (its heads are exactly a decode rank's), the only RDMA transfer from a CUDA pool
    `CacheStoreClient.open_transfer` does not refuse (8 KV heads, as Llama-3-8B and Qwen3-32B)."""
    from pdserve.cachestore.heads import HeadLayout, assigned_heads

    docs = render("gpu-rdma")
    tps = {}
    for role in GPU_RDMA_TP:
        args = by_kind(docs, "Deployment")[f"pdserve-{role}"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--device") + 1] == "cuda" and args[args.index("--transport") + 1] == "rdma"
        tps[role] = int(args[args.index("--tensor-parallel-size") + 1])
    for p in range(tps["prefill"]):
        sender = HeadLayout.of_rank(8, 256, p, tps["prefill"])
        for d in range(tps["decode"]):
            receiver = HeadLayout.of_rank(8, 256, d, tps["decode"])
            if assigned_heads(sender, receiver) is not None:  # this rank writes into that one: whole blocks
                assert (sender.first, sender.count) == (receiver.first, receiver.count), (p, d)


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
