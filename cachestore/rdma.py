"""RDMA transport over pyverbs: one MR for the whole pool, RC QPs, RDMA WRITE of coalesced runs.

NOT EXERCISED ON THESE MACHINES: the development and CI kernels have no
InfiniBand/RoCE support at all (not even soft-RoCE), so no verbs call here has
run. The pure parts (remote address arithmetic, work-request batching, QP
attribute values, the QP state machine) are unit-tested on CPU; the verbs calls
are kept in this one module. Install with `pip install pdserve[rdma]` on hosts
whose rdma-core matches the pyverbs build.

Protocol: the receiver registers its pool once (one MR) and exposes its base
address and rkey in the session credentials. Each sender connection opens a
TCP control channel (same handshake as the tcp transport), exchanges RC QP
info with the receiver (CONNECT frame), then for every run posts an RDMA WRITE
from its own registered pool and, once the work completion arrives, sends a
NOTIFY frame on the control channel; the receiver validates it exactly like a
TCP write header and acknowledges it.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import asdict, dataclass
from typing import NamedTuple

from cachestore.geometry import PoolGeometry, Run

log = logging.getLogger("pdserve.cachestore")
MAX_WR_PER_POST = 32
"""Work requests chained into one post_send (bounded by the QP's max_send_wr)."""


def rdma_devices() -> list[str]:
    """Names of RDMA devices, [] when pyverbs is missing or the host has none.

    pyverbs' get_device_list() raises PyverbsRDMAError instead of returning []
    on hosts without RDMA support, so any error means "no device"."""
    try:
        from pyverbs.device import get_device_list
    except ImportError:
        return []
    try:
        return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in get_device_list()]
    except Exception as e:  # PyverbsRDMAError: "Failed to get devices list"
        log.info("no RDMA devices: %s", e)
        return []


class WriteRequest(NamedTuple):
    """One RDMA WRITE: `length` bytes from local_addr (lkey) to remote_addr (rkey)."""

    wr_id: int
    local_addr: int
    length: int
    remote_addr: int


def plan_writes(layer: int, runs: list[Run], local: PoolGeometry, local_base: int, remote: PoolGeometry,
                remote_base: int, first_wr_id: int = 0, max_per_post: int = MAX_WR_PER_POST) -> list[list[WriteRequest]]:
    """Work requests for `runs` of `layer`, batched into chains of at most `max_per_post`."""
    assert local.block_bytes == remote.block_bytes, "geometries disagree on block size"
    wrs = [WriteRequest(first_wr_id + i, local_base + local.offset(layer, r.src_block), r.count * local.block_bytes,
                        remote_base + remote.offset(layer, r.dst_block)) for i, r in enumerate(runs)]
    return [wrs[i:i + max_per_post] for i in range(0, len(wrs), max_per_post)]


@dataclass(frozen=True)
class QpInfo:
    """What each side of an RC connection tells the other (over the TCP control channel)."""

    qp_num: int
    lid: int
    gid: str
    """Hex GID (RoCE needs it; IB can use the LID)."""
    psn: int = 0


class QpState(enum.IntEnum):
    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    ERROR = 4


_NEXT = {QpState.RESET: QpState.INIT, QpState.INIT: QpState.RTR, QpState.RTR: QpState.RTS}


def next_state(state: QpState, target: QpState) -> QpState:
    """RC QPs go RESET -> INIT -> RTR -> RTS in order; any state may drop to ERROR."""
    if target == QpState.ERROR or _NEXT.get(state) == target:
        return target
    raise ValueError(f"illegal QP transition {state.name} -> {target.name}")


def qp_attr_values(state: QpState, remote: QpInfo | None, *, port: int = 1, gid_index: int = 0,
                   mtu: int = 5, max_rd_atomic: int = 1) -> dict:
    """Attribute values for modify_qp into `state` (pure: what QPAttr is filled with)."""
    if state == QpState.INIT:
        # remote write is all the receiver's MR needs; local write for the sender's own MR
        return {"qp_state": "INIT", "pkey_index": 0, "port_num": port, "qp_access_flags": ("LOCAL_WRITE", "REMOTE_WRITE")}
    if state == QpState.RTR:
        assert remote is not None, "RTR needs the peer's QP info"
        return {"qp_state": "RTR", "path_mtu": mtu, "dest_qp_num": remote.qp_num, "rq_psn": remote.psn,
                "max_dest_rd_atomic": max_rd_atomic, "min_rnr_timer": 12,
                "ah": {"dlid": remote.lid, "port_num": port, "is_global": bool(remote.gid), "dgid": remote.gid,
                       "sgid_index": gid_index, "hop_limit": 1}}
    if state == QpState.RTS:
        return {"qp_state": "RTS", "sq_psn": 0, "timeout": 14, "retry_cnt": 7, "rnr_retry": 7,
                "max_rd_atomic": max_rd_atomic}
    raise ValueError(f"no attributes for {state.name}")


class RdmaResources:
    """Device context, protection domain, ONE memory region over the whole pool, and a CQ.

    Registering the pool once (not per block) is what makes per-request
    transfers cheap; the pool must be a plain allocation (cudaMalloc / malloc),
    never a stream-ordered allocator region, which GPUDirect cannot register."""

    def __init__(self, device: str, address: int, length: int, cq_depth: int = 1024) -> None:
        from pyverbs import enums
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.mr import MR
        from pyverbs.pd import PD

        self.ctx = Context(name=device)
        self.pd = PD(self.ctx)
        access = enums.IBV_ACCESS_LOCAL_WRITE | enums.IBV_ACCESS_REMOTE_WRITE
        self.mr = MR(self.pd, length, access, address=address)
        self.cq = CQ(self.ctx, cq_depth, None, None, 0)
        self.state = QpState.RESET

    def create_qp(self, max_send_wr: int = 256):
        from pyverbs import enums
        from pyverbs.qp import QP, QPCap, QPInitAttr
        cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        return QP(self.pd, QPInitAttr(qp_type=enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))

    def local_info(self, qp) -> QpInfo:
        port = self.ctx.query_port(1)
        gid = self.ctx.query_gid(1, 0)
        return QpInfo(qp_num=qp.qp_num, lid=port.lid, gid=str(gid))

    def connect(self, qp, remote: QpInfo, port: int = 1) -> None:
        """Drive the RC QP RESET -> INIT -> RTR -> RTS towards `remote`."""
        from pyverbs import enums
        from pyverbs.addr import AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr
        state = QpState.RESET
        for target in (QpState.INIT, QpState.RTR, QpState.RTS):
            state = next_state(state, target)
            values = qp_attr_values(target, remote, port=port)
            attr = QPAttr(port_num=port)
            if target == QpState.INIT:
                attr.qp_access_flags = enums.IBV_ACCESS_LOCAL_WRITE | enums.IBV_ACCESS_REMOTE_WRITE
                qp.to_init(attr)
            elif target == QpState.RTR:
                ah = values["ah"]
                gr = GlobalRoute(dgid=remote.gid, sgid_index=ah["sgid_index"]) if ah["is_global"] else None
                attr.ah_attr = AHAttr(port_num=port, dlid=ah["dlid"], is_global=int(ah["is_global"]), gr=gr)
                attr.dest_qp_num, attr.rq_psn = values["dest_qp_num"], values["rq_psn"]
                attr.path_mtu, attr.max_dest_rd_atomic = values["path_mtu"], values["max_dest_rd_atomic"]
                attr.min_rnr_timer = values["min_rnr_timer"]
                qp.to_rtr(attr)
            else:
                for key in ("sq_psn", "timeout", "retry_cnt", "rnr_retry", "max_rd_atomic"):
                    setattr(attr, key, values[key])
                qp.to_rts(attr)
        self.state = state

    def post_writes(self, qp, batch: list[WriteRequest], rkey: int) -> None:
        """Chain one batch of RDMA WRITEs (only the last is signaled) and wait for its completion."""
        from pyverbs import enums
        from pyverbs.wr import SGE, SendWR
        wrs = []
        for i, w in enumerate(batch):
            flags = enums.IBV_SEND_SIGNALED if i == len(batch) - 1 else 0
            wr = SendWR(wr_id=w.wr_id, opcode=enums.IBV_WR_RDMA_WRITE, num_sge=1,
                        sg=[SGE(w.local_addr, w.length, self.mr.lkey)], send_flags=flags)
            wr.set_wr_rdma(rkey, w.remote_addr)
            if wrs:
                wrs[-1].set_next_wr(wr)
            wrs.append(wr)
        qp.post_send(wrs[0])
        while True:
            n, wcs = self.cq.poll(1)
            if n:
                if wcs[0].status != enums.IBV_WC_SUCCESS:
                    raise OSError(f"RDMA write failed with work completion status {wcs[0].status}")
                return


class RdmaChannel:
    """Sender side of the rdma transport (see the module docstring). Not exercised here."""

    broken = False

    def __init__(self, client, creds) -> None:
        devices = rdma_devices()
        if not devices:
            raise OSError("rdma transport selected but this host has no RDMA device")
        self.client = client
        self.creds = creds
        self.res = RdmaResources(devices[0], client.region.address, len(client.region))
        self.qp = self.res.create_qp()
        from cachestore.tcp_sender import TcpChannel
        ours = self.res.local_info(self.qp)
        self.control = TcpChannel(client, creds.endpoint, hello=json.dumps(asdict(ours)).encode())
        if self.control.broken:
            raise OSError(self.control._connect_error)
        self.res.connect(self.qp, QpInfo(**json.loads(self.control.peer_hello)))

    def submit(self, transfer, layer: int, run: Run, ready_event) -> None:
        if ready_event is not None:
            ready_event.synchronize()
        remote = PoolGeometry(self.creds.num_layers, int(self.creds.rdma["num_blocks"]), self.creds.block_bytes)
        for batch in plan_writes(layer, [run], self.client.geometry, self.client.region.address, remote,
                                 int(self.creds.rdma["address"])):
            self.res.post_writes(self.qp, batch, int(self.creds.rdma["rkey"]))
        self.control.submit(transfer, layer, run, None, notify=True)

    def close(self) -> None:
        self.control.close()
