"""The verbs layer shared by both sides of the rdma transport: device choice, QP state machine,
the pool registration, QP connection, posting and completion polling.

NOT EXERCISED on hardware (no InfiniBand/RoCE here); in CI it drives the EMULATED verbs device
`cachestore.verbs_emu` (PDSERVE_RDMA_EMULATOR=1; across processes too, the QP exchange's GID naming
the peer's emulated device endpoint). Every verbs call goes through `verbs()`.
"""

from __future__ import annotations

import logging
import os
import time
import types

from pdserve.cachestore.rdma_qp import QpInfo, QpState, next_state, qp_attr_values

log = logging.getLogger("pdserve.cachestore")

EMULATOR_ENV = "PDSERVE_RDMA_EMULATOR"
COMPLETION_TIMEOUT = 30.0
"""Seconds a posted batch may wait for its completion before the channel is torn down."""
MAX_SEND_WR = 128
"""Send-queue depth of every QP: a chain is posted in pieces of at most this many WRs, each piece's
last WR signaled (the QPs have sq_sig_all=0) and waited for before the next, so the queue never
overflows; the CQ holds twice as many entries (a piece's flushed WRs all complete on an error)."""
ROCE_V2_HOP_LIMIT = 64
"""GRH hop limit towards a RoCE v2 peer (routable, UDP/IP); IB and RoCE v1 stay on the subnet (1)."""


def verbs() -> types.SimpleNamespace | types.ModuleType:
    """The verbs API in use: the emulated device when $PDSERVE_RDMA_EMULATOR=1, else pyverbs
    (ImportError when it is not installed)."""
    if os.environ.get(EMULATOR_ENV) == "1":
        import pdserve.cachestore.verbs_emu as emu

        return emu
    from pyverbs import enums
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR, MW, MWBindInfo
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR

    return types.SimpleNamespace(
        enums=enums,
        AHAttr=AHAttr,
        GID=GID,
        GlobalRoute=GlobalRoute,
        CQ=CQ,
        Context=Context,
        get_device_list=get_device_list,
        MR=MR,
        MW=MW,
        MWBindInfo=MWBindInfo,
        PD=PD,
        QP=QP,
        QPAttr=QPAttr,
        QPCap=QPCap,
        QPInitAttr=QPInitAttr,
        SGE=SGE,
        SendWR=SendWR,
    )


def rdma_devices() -> list[str]:
    """Names of RDMA devices, [] when pyverbs is missing or the host has none.

    pyverbs' get_device_list() raises PyverbsRDMAError instead of returning []
    on hosts without RDMA support, so any error means "no device"."""
    try:
        v = verbs()
    except ImportError:
        return []
    try:
        return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in v.get_device_list()]
    except Exception as e:  # PyverbsRDMAError: "Failed to get devices list"
        log.info("no RDMA devices: %s", e)
        return []


def device_choice() -> tuple[str, int, int]:
    """(device, port, GID index) from PDSERVE_RDMA_DEVICE / _PORT / _GID_INDEX; OSError if absent."""
    devices = rdma_devices()
    name = os.environ.get("PDSERVE_RDMA_DEVICE") or (devices[0] if devices else "")
    if name not in devices:
        raise OSError(f"RDMA device {name!r} not found (devices: {', '.join(devices) or 'none'})")
    return name, int(os.environ.get("PDSERVE_RDMA_PORT", "1")), int(os.environ.get("PDSERVE_RDMA_GID_INDEX", "0"))


class RdmaResources:
    """Device context, protection domain and ONE memory region over the whole pool (or over its
    pinned host staging buffer, `cachestore.rdma_memory`).

    Registering the pool once (not per block) is what makes per-request transfers cheap; the pool
    must be a plain allocation (cudaMalloc / malloc), never a stream-ordered allocator region, which
    GPUDirect cannot register. `remote_access` is what the pool MR itself grants: nothing remote on
    either side (the receiver grants per-session windows or MRs, `cachestore.rdma_access`);
    `mw_bind` lets the receiver bind type-2 windows to it."""

    def __init__(
        self,
        device: str,
        region,
        port: int = 1,
        gid_index: int = 0,
        mw_bind: bool = False,
        lanes: int = 0,
        block_bytes: int = 1,
    ) -> None:
        from pdserve.cachestore import rdma_memory

        v = self.v = verbs()
        self.port, self.gid_index = port, gid_index
        self.ctx = v.Context(name=device)
        # the path is what the port says, never a constant: its active MTU, and its GID's type
        # (RoCE v2 is routed: the GRH needs a hop limit above 1)
        port_attr = self.ctx.query_port(port)
        self.active_mtu = int(port_attr.active_mtu)
        try:
            gid_type = self.ctx.query_gid_type(port, gid_index)
        except Exception as e:  # an old rdma-core without ibv_query_gid_type: take the link layer's default
            log.info("cannot query the RDMA GID type (%s): assuming IB/RoCE v1", e)
            gid_type = v.enums.IBV_GID_TYPE_IB
        self.hop_limit = ROCE_V2_HOP_LIMIT if gid_type == v.enums.IBV_GID_TYPE_ROCE_V2 else 1
        self.pd = v.PD(self.ctx)
        access = v.enums.IBV_ACCESS_LOCAL_WRITE | (v.enums.IBV_ACCESS_MW_BIND if mw_bind else 0)
        # the pool itself (host memory, or a CUDA pool through GPUDirect) or a pinned staging buffer
        self.registration = rdma_memory.register(v, self.pd, region, access, lanes=lanes, block_bytes=block_bytes)
        self.mr = self.registration.mr
        self.address, self.length = self.registration.address, self.registration.length
        """What the QPs read from / write into: the pool's addresses, or the staging buffer's."""

    def create_qp(self):
        """An RC QP of MAX_SEND_WR send slots that signals only the WRs flagged so (sq_sig_all=0),
        with its own CQ (one poller per QP: no CQ shared between threads), deep enough for every
        WR of a piece to complete (on a flush)."""
        v = self.v
        cq = v.CQ(self.ctx, 2 * MAX_SEND_WR, None, None, 0)
        cap = v.QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        qp = v.QP(self.pd, v.QPInitAttr(qp_type=v.enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0))
        return qp, cq

    def local_info(self, qp) -> QpInfo:
        port = self.ctx.query_port(self.port)
        gid = self.ctx.query_gid(self.port, self.gid_index)
        return QpInfo(qp_num=qp.qp_num, lid=port.lid, gid=str(gid), mtu=self.active_mtu)

    def connect(self, qp, remote: QpInfo, responder: bool) -> None:
        """Drive the RC QP RESET -> INIT -> RTR -> RTS towards `remote`. Only a responder (the
        receiver) lets remote WRITEs in; the keys then decide where they may land."""
        v, port = self.v, self.port
        state = QpState.RESET
        for target in (QpState.INIT, QpState.RTR, QpState.RTS):
            state = next_state(state, target)
            mtu = min(self.active_mtu, remote.mtu or self.active_mtu)
            values = qp_attr_values(
                target, remote, port=port, gid_index=self.gid_index, mtu=mtu, hop_limit=self.hop_limit
            )
            attr = v.QPAttr(port_num=port)
            if target == QpState.INIT:
                attr.qp_access_flags = v.enums.IBV_ACCESS_LOCAL_WRITE | (
                    v.enums.IBV_ACCESS_REMOTE_WRITE if responder else 0
                )
                qp.to_init(attr)
            elif target == QpState.RTR:
                ah = values["ah"]
                gr = None
                if ah["is_global"]:  # pyverbs takes a GID object, never the string that travelled
                    gr = v.GlobalRoute(dgid=v.GID(remote.gid), sgid_index=ah["sgid_index"], hop_limit=ah["hop_limit"])
                attr.ah_attr = v.AHAttr(port_num=port, dlid=ah["dlid"], is_global=int(ah["is_global"]), gr=gr)
                attr.dest_qp_num, attr.rq_psn = values["dest_qp_num"], values["rq_psn"]
                attr.path_mtu, attr.max_dest_rd_atomic = values["path_mtu"], values["max_dest_rd_atomic"]
                attr.min_rnr_timer = values["min_rnr_timer"]
                qp.to_rtr(attr)
            else:
                for key in ("sq_psn", "timeout", "retry_cnt", "rnr_retry", "max_rd_atomic"):
                    setattr(attr, key, values[key])
                qp.to_rts(attr)

    def close(self) -> None:
        """Deregister the pool (the QPs using it are closed first by their owners)."""
        if hasattr(self.mr, "close"):
            self.mr.close()

    def run_chain(self, qp, cq, wrs: list, timeout: float | None = None) -> None:
        """Post `wrs` (their wr_ids set, in order) in pieces of at most MAX_SEND_WR linked through
        `next_wr`, only each piece's last WR signaled, and wait for each piece's completion before the
        next: the send queue and the CQ can never overflow. OSError if any WR failed."""
        signaled = self.v.enums.IBV_SEND_SIGNALED
        for start in range(0, len(wrs), MAX_SEND_WR):
            piece = wrs[start : start + MAX_SEND_WR]
            for wr in piece:
                wr.send_flags = 0
            piece[-1].send_flags = signaled
            for a, b in zip(piece, piece[1:]):
                a.next_wr = b  # `piece` keeps every WR alive until the post returns
            qp.post_send(piece[0])
            wait_completion(self.v, cq, piece[-1].wr_id, timeout)


def wait_completion(v, cq, wr_id: int, timeout: float | None = None) -> None:
    """Poll `cq` (on the calling thread, never the engine's) until `wr_id` completes; OSError on an
    error completion or when none arrives in time (a lost completion: the QP's state is unknown)."""
    timeout = timeout or COMPLETION_TIMEOUT
    deadline = time.monotonic() + timeout
    spins = 0
    while time.monotonic() < deadline:
        n, wcs = cq.poll(1)
        if not n:
            spins += 1
            time.sleep(0 if spins < 100 else 0.0005)  # spin briefly, then back off
            continue
        wc = wcs[0]
        if wc.status != v.enums.IBV_WC_SUCCESS:
            raise OSError(
                f"work request {wc.wr_id} failed with completion status {wc.status}"
                + (" (remote access error)" if wc.status == v.enums.IBV_WC_REM_ACCESS_ERR else "")
            )
        if wc.wr_id == wr_id:
            return
    raise OSError(f"no completion for work request {wr_id} within {timeout:.0f}s")
