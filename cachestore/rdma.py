"""RDMA transport over verbs: RC QPs, RDMA WRITE of coalesced runs, completion before NOTIFY.

Where it runs: on real hardware through pyverbs (NOT EXERCISED on hardware: the development and
CI kernels have no InfiniBand/RoCE support), and in CI on the in-process emulated verbs device
`cachestore.verbs_emu` (PDSERVE_RDMA_EMULATOR=1), which follows the verbs rules for keys, bounds,
access, QP states and completions. Every verbs call goes through `verbs()`, so the same code drives
both. Install with `pip install pdserve[rdma]` on hosts whose rdma-core matches the pyverbs build.

Protocol: the receiver registers its pool once (one MR) and exposes its base address and rkey in
the session credentials. Each sender channel opens a TCP control channel (same handshake as the
tcp transport), exchanges RC QP info with the receiver (CONNECT frame), then for every run posts
an RDMA WRITE from its own registered pool and, once the work completion arrives, sends a NOTIFY
frame on the control channel; the receiver validates it exactly like a TCP write header and
acknowledges it. Setup, posting and CQ polling run on the channel's own thread: the engine thread
(the per-layer hook) only enqueues.

Device selection: PDSERVE_RDMA_DEVICE (default: the first device), PDSERVE_RDMA_PORT (default 1)
and PDSERVE_RDMA_GID_INDEX (default 0).
"""

from __future__ import annotations

import enum
import json
import logging
import os
import queue
import threading
import time
import types
from dataclasses import asdict, dataclass
from typing import NamedTuple

from cachestore.geometry import PoolGeometry, Run

log = logging.getLogger("pdserve.cachestore")
MAX_WR_PER_POST = 32
"""Work requests chained into one post_send (bounded by the QP's max_send_wr)."""


EMULATOR_ENV = "PDSERVE_RDMA_EMULATOR"
COMPLETION_TIMEOUT = 30.0
"""Seconds a posted batch may wait for its completion before the channel is torn down."""


def verbs() -> types.SimpleNamespace | types.ModuleType:
    """The verbs API in use: the emulated device when $PDSERVE_RDMA_EMULATOR=1, else pyverbs
    (ImportError when it is not installed)."""
    if os.environ.get(EMULATOR_ENV) == "1":
        import cachestore.verbs_emu as emu
        return emu
    from pyverbs import enums
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR
    return types.SimpleNamespace(enums=enums, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ, Context=Context,
                                 get_device_list=get_device_list, MR=MR, PD=PD, QP=QP, QPAttr=QPAttr, QPCap=QPCap,
                                 QPInitAttr=QPInitAttr, SGE=SGE, SendWR=SendWR)


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

    def __init__(self, device: str, address: int, length: int, cq_depth: int = 1024, port: int = 1,
                 gid_index: int = 0) -> None:
        v = self.v = verbs()
        self.port, self.gid_index = port, gid_index
        self.ctx = v.Context(name=device)
        self.pd = v.PD(self.ctx)
        access = v.enums.IBV_ACCESS_LOCAL_WRITE | v.enums.IBV_ACCESS_REMOTE_WRITE
        self.mr = v.MR(self.pd, length, access, address=address)
        self.cq = v.CQ(self.ctx, cq_depth, None, None, 0)
        self.state = QpState.RESET

    def create_qp(self, max_send_wr: int = 256):
        v = self.v
        cap = v.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        return v.QP(self.pd, v.QPInitAttr(qp_type=v.enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))

    def local_info(self, qp) -> QpInfo:
        port = self.ctx.query_port(self.port)
        gid = self.ctx.query_gid(self.port, self.gid_index)
        return QpInfo(qp_num=qp.qp_num, lid=port.lid, gid=str(gid))

    def connect(self, qp, remote: QpInfo) -> None:
        """Drive the RC QP RESET -> INIT -> RTR -> RTS towards `remote`."""
        v, port = self.v, self.port
        state = QpState.RESET
        for target in (QpState.INIT, QpState.RTR, QpState.RTS):
            state = next_state(state, target)
            values = qp_attr_values(target, remote, port=port, gid_index=self.gid_index)
            attr = v.QPAttr(port_num=port)
            if target == QpState.INIT:
                attr.qp_access_flags = v.enums.IBV_ACCESS_LOCAL_WRITE | v.enums.IBV_ACCESS_REMOTE_WRITE
                qp.to_init(attr)
            elif target == QpState.RTR:
                ah = values["ah"]
                gr = v.GlobalRoute(dgid=remote.gid, sgid_index=ah["sgid_index"]) if ah["is_global"] else None
                attr.ah_attr = v.AHAttr(port_num=port, dlid=ah["dlid"], is_global=int(ah["is_global"]), gr=gr)
                attr.dest_qp_num, attr.rq_psn = values["dest_qp_num"], values["rq_psn"]
                attr.path_mtu, attr.max_dest_rd_atomic = values["path_mtu"], values["max_dest_rd_atomic"]
                attr.min_rnr_timer = values["min_rnr_timer"]
                qp.to_rtr(attr)
            else:
                for key in ("sq_psn", "timeout", "retry_cnt", "rnr_retry", "max_rd_atomic"):
                    setattr(attr, key, values[key])
                qp.to_rts(attr)
        self.state = state

    def post_writes(self, qp, batch: list[WriteRequest], rkey: int) -> int:
        """Chain one batch of RDMA WRITEs (only the last is signaled); returns the wr_id to wait for.
        Raises OSError if the post is refused (QP not in RTS)."""
        v = self.v
        wrs = []
        for i, w in enumerate(batch):
            flags = v.enums.IBV_SEND_SIGNALED if i == len(batch) - 1 else 0
            wr = v.SendWR(wr_id=w.wr_id, opcode=v.enums.IBV_WR_RDMA_WRITE, num_sge=1,
                          sg=[v.SGE(w.local_addr, w.length, self.mr.lkey)], send_flags=flags)
            wr.set_wr_rdma(rkey, w.remote_addr)
            if wrs:
                wrs[-1].set_next_wr(wr)
            wrs.append(wr)
        qp.post_send(wrs[0])
        return batch[-1].wr_id

    def wait_completion(self, wr_id: int, timeout: float | None = None) -> None:
        """Poll the CQ (on the calling channel thread) until `wr_id` completes; OSError on an error
        completion or when none arrives in time (a lost completion: the QP's state is unknown)."""
        timeout = timeout or COMPLETION_TIMEOUT
        deadline = time.monotonic() + timeout
        spins = 0
        while time.monotonic() < deadline:
            n, wcs = self.cq.poll(1)
            if not n:
                spins += 1
                time.sleep(0 if spins < 100 else 0.0005)  # spin briefly, then back off
                continue
            wc = wcs[0]
            if wc.status != self.v.enums.IBV_WC_SUCCESS:
                raise OSError(f"RDMA write failed with work completion status {wc.status}")
            if wc.wr_id == wr_id:
                return
        raise OSError(f"no completion for RDMA write {wr_id} within {timeout:.0f}s")


class RdmaChannel:
    """Sender side of the rdma transport (see the module docstring).

    One thread owns the channel: it sets up the control connection and the QP (off the event
    loop), then takes queued runs in order, waits for the layer's CUDA event, posts the WRITE,
    polls its completion and only then sends the NOTIFY. Any verbs failure fails the run's transfer
    cleanly and marks the channel broken; the client then opens a fresh channel (new QP) for the
    next transfer."""

    def __init__(self, client, creds) -> None:
        self.client = client
        self.creds = creds
        self.broken = False
        self.error = ""
        self.poll_threads: set[str] = set()
        """Names of the threads that polled this channel's CQ (tests assert it is never the engine's)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wr_ids = 0
        self.res = self.qp = self.control = None
        self._thread = threading.Thread(target=self._run, name="cachestore-rdma", daemon=True)
        self._thread.start()

    def submit(self, transfer, layer: int, run: Run, ready_event) -> None:
        """Engine thread: enqueue only."""
        if self.broken:
            transfer._on_ack(False, self.error or "RDMA channel closed")
            return
        self._queue.put((transfer, layer, run, ready_event))

    def _setup(self) -> None:
        from cachestore.tcp_sender import TcpChannel
        device, port, gid_index = device_choice()
        region = self.client.region
        self.res = RdmaResources(device, region.address, len(region), port=port, gid_index=gid_index)
        self.qp = self.res.create_qp()
        ours = self.res.local_info(self.qp)
        self.control = TcpChannel(self.client, self.creds.endpoint, hello=json.dumps(asdict(ours)).encode())
        if self.control.broken:
            raise OSError(self.control._connect_error)
        self.res.connect(self.qp, QpInfo(**json.loads(self.control.peer_hello)))

    def _run(self) -> None:
        try:
            self._setup()
        except Exception as e:  # OSError, or a verbs error: fail what is queued, never the caller
            self._fail(f"cannot set up RDMA to {self.creds.endpoint}: {e}")
            return
        remote = PoolGeometry(self.creds.num_layers, int(self.creds.rdma["num_blocks"]), self.creds.block_bytes)
        base, rkey = int(self.creds.rdma["address"]), int(self.creds.rdma["rkey"])
        while True:
            item = self._queue.get()
            if item is None:
                return
            transfer, layer, run, ready_event = item
            if transfer.failed:
                continue
            try:
                if ready_event is not None:
                    ready_event.synchronize()  # this thread waits for the layer's kernels, not the engine
                self.poll_threads.add(threading.current_thread().name)
                for batch in plan_writes(layer, [run], self.client.geometry, self.client.region.address, remote,
                                         base, first_wr_id=self._wr_ids):
                    self._wr_ids += len(batch)
                    self.res.wait_completion(self.res.post_writes(self.qp, batch, rkey))
            except OSError as e:
                transfer._on_ack(False, str(e))
                self._fail(f"RDMA channel to {self.creds.endpoint} failed: {e}")
                return
            self.client.metrics.add_bytes("send", run.count * self.client.geometry.block_bytes)
            self.control.submit(transfer, layer, run, None, notify=True)

    def _fail(self, reason: str) -> None:
        """Mark the channel broken (the next transfer gets a new QP) and fail every queued run."""
        self.broken, self.error = True, reason
        log.warning("%s", reason)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0]._on_ack(False, reason)
        self._teardown()

    def _teardown(self) -> None:
        if self.control is not None:
            self.control.close()
        if self.qp is not None and hasattr(self.qp, "close"):
            self.qp.close()

    def close(self) -> None:
        self.broken = True
        self._queue.put(None)
        self._teardown()
