"""Work completions and completion queues of the emulated device (ibv_poll_cq(3)); shared by the
send engine (`queues`) and the wire responder (`wire`), which both complete work."""

from __future__ import annotations

import collections
import threading


class WC:
    """A work completion."""

    def __init__(self, wr_id: int, status: int, opcode: int, qp_num: int, byte_len: int = 0, imm_data: int = 0):
        self.wr_id, self.status, self.opcode, self.qp_num = wr_id, status, opcode, qp_num
        self.byte_len, self.imm_data = byte_len, imm_data


class CQ:
    """A completion queue; poll(n) returns (count, [WC]) like pyverbs."""

    def __init__(self, ctx, cqe: int, *_unused) -> None:
        self.ctx, self.depth = ctx, cqe
        self._wcs: collections.deque[WC] = collections.deque()
        self._lock = threading.Lock()
        self.overrun = False

    def push(self, wc: WC) -> None:
        if self.ctx.fabric.faults.take_drop():
            return
        with self._lock:
            if len(self._wcs) >= self.depth:
                self.overrun = True  # a real CQ overrun is an async error; tests check the flag
                return
            self._wcs.append(wc)

    def poll(self, num_entries: int = 1) -> tuple[int, list[WC]]:
        with self._lock:
            out = [self._wcs.popleft() for _ in range(min(num_entries, len(self._wcs)))]
        return len(out), out
