"""Completion queues, work requests and RC queue pairs of the emulated device.

Semantics from the verbs specification (IBTA vol. 1 ch. 10.3, 11.4; ibv_modify_qp(3), ibv_post_send(3),
ibv_poll_cq(3)):
  * An RC QP moves RESET -> INIT -> RTR -> RTS in that order; any state may move to ERR, and ERR only
    back to RESET. post_send is refused (EINVAL) before RTS; the responder accepts in RTR or RTS.
  * Work requests execute in order on the QP's send engine (a thread here, the NIC there) after
    post_send returns. A WRITE lands only if the responder's rkey names an MR/MW that grants
    REMOTE_WRITE over the whole target range (for a type-2 MW: through this very QP).
  * A WR produces a completion if it is signaled (IBV_SEND_SIGNALED, pyverbs' default) or the QP
    signals all (sq_sig_all, pyverbs' default 1); unsignaled WRs complete silently on success. An
    error always completes, moves the QP to ERR, and every WR still queued (and any posted later)
    completes with WR_FLUSH_ERR.
  * The send queue holds max_send_wr WRs: a WR's slot is freed only when its completion, or that of
    a later WR of the QP, is polled. post_send of a WR that does not fit raises ENOMEM (the WRs of
    the chain before it are posted, as ibv_post_send's bad_wr says).
  * A CQ that overflows (more completions than its depth unpolled) is an async error: every QP
    completing into it moves to ERR.
  * BIND_MW (type 2) gives the window the key the WR carries (`wr.rkey`, from set_bind_wr); the MW
    object's own rkey does not change. LOCAL_INV names the key in `imm_data` (pyverbs has no other field for it).
  * WRITE_WITH_IMM consumes a receive WR at the responder (none posted: RNR retries exhausted) and
    delivers the immediate in a RECV_RDMA_WITH_IMM completion there.
  * At the responder, a key/range/access violation is a class C error: NAK "remote access error"
    (IBV_WC_REM_ACCESS_ERR at the requester), and the responder QP moves to ERR too; a responder QP
    without REMOTE_WRITE access answers NAK "invalid request" (IBV_WC_REM_INV_REQ_ERR), also class C.

A QP moved to RTR with an emulated destination GID talks to its peer over the wire
(`verbs_emu.wire`, possibly another process); without one, to a QP of this process by number.
"""

from __future__ import annotations

import collections
import ctypes
import queue
import threading
import time

from pdserve.cachestore.verbs_emu import enums
from pdserve.cachestore.verbs_emu.completion import CQ, WC
from pdserve.cachestore.verbs_emu.memory import MR, MW, VerbsError, remote_target
from pdserve.cachestore.verbs_emu.params import QPAttr, QPInitAttr, RecvWR, SendWR
from pdserve.cachestore.verbs_emu.wire import RequesterLink, parse_gid

_ORDER = {
    enums.IBV_QPS_RESET: enums.IBV_QPS_INIT,
    enums.IBV_QPS_INIT: enums.IBV_QPS_RTR,
    enums.IBV_QPS_RTR: enums.IBV_QPS_RTS,
}


class QP:
    """An RC queue pair with an in-order send engine (see the module docstring)."""

    def __init__(self, pd, init_attr: QPInitAttr) -> None:
        if init_attr.qp_type != enums.IBV_QPT_RC:
            raise VerbsError("this emulated device creates RC QPs only")
        if not isinstance(init_attr, QPInitAttr):
            raise TypeError("QP() takes a QPInitAttr")
        if init_attr.scq is None or init_attr.rcq is None:
            raise VerbsError("ibv_create_qp: an RC QP needs a send and a receive CQ (EINVAL)")
        self.pd, self.fabric = pd, pd.ctx.fabric
        self.scq: CQ = init_attr.scq
        self.rcq: CQ = init_attr.rcq
        self.cap = init_attr.cap
        self.max_send_wr = int(init_attr.cap.max_send_wr)
        self.sq_sig_all = bool(init_attr.sq_sig_all)
        self._posted = 0
        """WRs posted so far; each takes a send-queue slot until a completion at or after it is polled."""
        self._retired = 0
        self.scq.attach(self)
        self.rcq.attach(self)
        self.qp_state = enums.IBV_QPS_RESET
        self.dest_qp_num = 0
        self.remote: tuple[str, int] | None = None
        """The peer's device endpoint when connected through an emulated GID (the wire path)."""
        self._link: RequesterLink | None = None
        self._rq_psn = 0
        self.access = 0
        self.qp_num = self.fabric.add_qp(self)
        self._sq: queue.SimpleQueue = queue.SimpleQueue()
        self._rq: collections.deque[RecvWR] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        self.engine_thread = threading.Thread(target=self._engine, name=f"emu-qp-{self.qp_num}", daemon=True)
        self.engine_thread.start()

    # state machine ------------------------------------------------------------------------------
    def modify(self, attr: QPAttr) -> None:
        target = attr.qp_state
        with self._lock:
            ok = (
                target == enums.IBV_QPS_ERR
                or _ORDER.get(self.qp_state) == target
                or (target == enums.IBV_QPS_RESET and self.qp_state == enums.IBV_QPS_ERR)
            )
            if not ok:
                raise VerbsError(f"ibv_modify_qp: illegal transition {self.qp_state} -> {target} (EINVAL)")
            if target == enums.IBV_QPS_INIT:
                self.access = attr.qp_access_flags
            if target == enums.IBV_QPS_RTR:
                active = self.pd.ctx.query_port(int(attr.ah_attr.port_num or 1)).active_mtu
                if attr.path_mtu > active:
                    raise VerbsError(
                        f"ibv_modify_qp: path MTU {attr.path_mtu} above the port's active MTU {active} (EINVAL)"
                    )
                self.dest_qp_num = attr.dest_qp_num
                self.remote, self._rq_psn = _wire_address(attr), int(getattr(attr, "rq_psn", 0) or 0)
            if target == enums.IBV_QPS_RTS and self.remote is not None:
                self._link = RequesterLink(self, self.remote, int(getattr(attr, "sq_psn", 0) or 0))
            if target == enums.IBV_QPS_RESET:
                self._rq.clear()
                self.remote = None
                link, self._link = self._link, None
                if link is not None:
                    link.close()
            self.qp_state = target

    def to_init(self, attr: QPAttr) -> None:
        attr.qp_state = enums.IBV_QPS_INIT
        self.modify(attr)

    def to_rtr(self, attr: QPAttr) -> None:
        attr.qp_state = enums.IBV_QPS_RTR
        self.modify(attr)

    def to_rts(self, attr: QPAttr) -> None:
        attr.qp_state = enums.IBV_QPS_RTS
        self.modify(attr)

    def to_error(self) -> None:
        """Fault hook and error path: the QP moves to ERR; queued and later WRs flush."""
        self.modify(QPAttr(qp_state=enums.IBV_QPS_ERR))

    # posting --------------------------------------------------------------------------------------
    def post_send(self, wr: SendWR) -> None:
        """Queue `wr` and the WRs chained behind it (`next_wr`) on the send engine."""
        if self.qp_state in (enums.IBV_QPS_RESET, enums.IBV_QPS_INIT, enums.IBV_QPS_RTR):
            raise VerbsError("ibv_post_send: QP is not in RTS (EINVAL)")
        chain: SendWR | None = wr
        index = 0
        while chain is not None:
            if not isinstance(chain, SendWR):
                raise TypeError(f"post_send() takes a SendWR chain, got {type(chain).__name__}")
            with self._lock:
                if self._posted - self._retired >= self.max_send_wr:
                    raise VerbsError(
                        f"ibv_post_send: send queue full ({self.max_send_wr} WRs outstanding) at WR {index} "
                        "of the chain (ENOMEM)"
                    )
                self._posted += 1
                seq = self._posted
            self._sq.put((seq, chain))
            chain, index = chain._next, index + 1

    def retire(self, seq: int) -> None:
        """A completion of this QP's WR `seq` was polled: its slot and every earlier one are free."""
        with self._lock:
            self._retired = max(self._retired, seq)

    def post_recv(self, wr: RecvWR) -> None:
        if self.qp_state == enums.IBV_QPS_RESET:
            raise VerbsError("ibv_post_recv: QP is in RESET (EINVAL)")
        self._rq.append(wr)

    def close(self) -> None:
        self._closed = True
        self.fabric.remove_qp(self.qp_num)
        self._sq.put(None)
        link = self._link
        if link is not None:
            link.close()

    # the send engine --------------------------------------------------------------------------------
    def _engine(self) -> None:
        while True:
            item = self._sq.get()
            if item is None or self._closed:
                return
            seq, wr = item
            if self.qp_state == enums.IBV_QPS_ERR:
                if self._link is not None:
                    self._link.close()  # an ERR QP sends nothing more
                self._complete(seq, wr, enums.IBV_WC_WR_FLUSH_ERR, 0)
                continue
            status, nbytes = self._execute(wr)
            if status != enums.IBV_WC_SUCCESS:
                self.to_error()
            self._complete(seq, wr, status, nbytes)

    def _complete(self, seq: int, wr: SendWR, status: int, nbytes: int) -> None:
        signaled = self.sq_sig_all or wr.send_flags & enums.IBV_SEND_SIGNALED
        if status == enums.IBV_WC_SUCCESS and not signaled:
            return
        opcode = {enums.IBV_WR_BIND_MW: enums.IBV_WC_BIND_MW, enums.IBV_WR_LOCAL_INV: enums.IBV_WC_LOCAL_INV}.get(
            wr.opcode, enums.IBV_WC_RDMA_WRITE
        )
        self.scq.push(WC(wr.wr_id, status, opcode, self.qp_num, nbytes, qp=self, seq=seq))

    def _execute(self, wr: SendWR) -> tuple[int, int]:
        if wr.opcode == enums.IBV_WR_BIND_MW:
            if wr._bind is None:  # set by set_bind_wr
                return enums.IBV_WC_MW_BIND_ERR, 0
            mw, info = wr._bind
            return mw.bind(self, info, wr._bind_rkey), 0
        if wr.opcode == enums.IBV_WR_LOCAL_INV:  # the key travels in imm_data (verbs' union with it)
            mw = self.fabric.key(int(wr.imm_data))
            if not isinstance(mw, MW) or mw.pd is not self.pd:
                return enums.IBV_WC_LOC_PROT_ERR, 0
            return mw.invalidate(int(wr.imm_data)), 0
        if wr.opcode not in (enums.IBV_WR_RDMA_WRITE, enums.IBV_WR_RDMA_WRITE_WITH_IMM):
            return enums.IBV_WC_LOC_QP_OP_ERR, 0
        return self._write(wr)

    def _write(self, wr: SendWR) -> tuple[int, int]:
        if self.fabric.faults.write_delay_s:
            time.sleep(self.fabric.faults.write_delay_s)
        sges = wr._sges
        rkey, remote_addr = wr._rdma
        length = sum(n for _, n, _ in sges)
        for addr, n, lkey in sges:  # the local side: each SGE inside an MR of this PD, by its lkey
            mr = self.fabric.key(lkey)
            if not isinstance(mr, MR) or not mr.valid or mr.pd is not self.pd or not mr.covers(addr, n):
                return enums.IBV_WC_LOC_PROT_ERR, 0
        if self._link is not None:  # the wire: the responder (maybe in another process) checks and answers
            imm = wr.imm_data if wr.opcode == enums.IBV_WR_RDMA_WRITE_WITH_IMM else None
            status = self._link.write(sges, rkey, remote_addr, imm)
            return status, length if status == enums.IBV_WC_SUCCESS else 0
        responder = self.fabric.qp(self.dest_qp_num)
        if responder is None or responder.qp_state not in (enums.IBV_QPS_RTR, enums.IBV_QPS_RTS):
            return enums.IBV_WC_RETRY_EXC_ERR, 0  # no ACK ever comes back
        if not responder.access & enums.IBV_ACCESS_REMOTE_WRITE:
            responder.to_error()  # class C at the responder too
            return enums.IBV_WC_REM_INV_REQ_ERR, 0
        # the responder checks the rkey, the range and the access at execution time, and the key
        # cannot be invalidated between that check and the copy (its lock)
        target = self.fabric.key(rkey)
        lock = getattr(target, "lock", None)
        if lock is None:
            responder.to_error()
            return enums.IBV_WC_REM_ACCESS_ERR, 0
        with lock:
            if self.fabric.key(rkey) is not target or not remote_target(
                target, responder, remote_addr, length, enums.IBV_ACCESS_REMOTE_WRITE
            ):
                responder.to_error()
                return enums.IBV_WC_REM_ACCESS_ERR, 0
            return self._land(wr, responder, length)

    def _land(self, wr: SendWR, responder: "QP", length: int) -> tuple[int, int]:
        recv = None
        if wr.opcode == enums.IBV_WR_RDMA_WRITE_WITH_IMM:
            if not responder._rq:
                return enums.IBV_WC_RNR_RETRY_EXC_ERR, 0
            recv = responder._rq.popleft()
        dst = wr._rdma[1]
        for addr, n, _ in wr._sges:
            ctypes.memmove(dst, addr, n)
            dst += n
        if recv is not None:
            responder.rcq.push(
                WC(
                    recv.wr_id,
                    enums.IBV_WC_SUCCESS,
                    enums.IBV_WC_RECV_RDMA_WITH_IMM,
                    responder.qp_num,
                    length,
                    wr.imm_data,
                )
            )
        return enums.IBV_WC_SUCCESS, length


def _wire_address(attr: QPAttr) -> tuple[str, int] | None:
    """The peer's device endpoint from RTR's address handle, if it carries an emulated GID."""
    ah = attr.ah_attr
    return parse_gid(ah.dgid) if ah is not None and ah.is_global else None
