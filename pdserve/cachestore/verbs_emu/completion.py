"""Work completions and completion queues of the emulated device (ibv_poll_cq(3)); shared by the
send engine (`queues`) and the wire responder (`wire`), which both complete work."""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any


class WC:
    """A work completion; `qp`/`seq` (emulator-internal) say which send-queue slots its polling frees."""

    def __init__(
        self,
        wr_id: int,
        status: int,
        opcode: int,
        qp_num: int,
        byte_len: int = 0,
        imm_data: int = 0,
        qp: Any = None,
        seq: int = 0,
    ) -> None:
        self.wr_id, self.status, self.opcode, self.qp_num = wr_id, status, opcode, qp_num
        self.byte_len, self.imm_data = byte_len, imm_data
        self._qp, self._seq = qp, seq


class CQ:
    """A completion queue of `cqe` entries; poll(n) returns (count, [WC]) like pyverbs. One that
    overflows is an async error (IBV_EVENT_CQ_ERR): `overrun` is set and every QP attached to it
    moves to ERR, so the lost completion cannot go unnoticed."""

    def __init__(self, ctx, cqe: int, *_unused) -> None:
        self.ctx, self.depth = ctx, cqe
        self._wcs: collections.deque[WC] = collections.deque()
        self._lock = threading.Lock()
        self._qps: weakref.WeakSet = weakref.WeakSet()
        self.overrun = False

    def attach(self, qp) -> None:
        """`qp` completes into this CQ (ibv_create_qp's send_cq/recv_cq)."""
        with self._lock:
            self._qps.add(qp)

    def push(self, wc: WC) -> None:
        if self.ctx.fabric.faults.take_drop():
            return
        with self._lock:
            overflow = len(self._wcs) >= self.depth
            if overflow:
                self.overrun = True
                qps = list(self._qps)
            else:
                self._wcs.append(wc)
        if overflow:
            for qp in qps:
                qp.to_error()

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        with self._lock:
            out = [self._wcs.popleft() for _ in range(min(num_entries, len(self._wcs)))]
        for wc in out:
            if wc._qp is not None:
                wc._qp.retire(wc._seq)
        return len(out), out
