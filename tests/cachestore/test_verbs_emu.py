"""The emulated verbs device keeps the verbs rules: keys, bounds, access, windows, QP states, completions."""

from __future__ import annotations

import ctypes
import time

import pytest

from pdserve.cachestore.verbs_emu import (
    CQ,
    MR,
    MW,
    PD,
    QP,
    Context,
    MWBindInfo,
    QPAttr,
    QPCap,
    QPInitAttr,
    RecvWR,
    SendWR,
    SGE,
    VerbsError,
    enums,
)
from pdserve.cachestore.verbs_emu.device import FABRIC

LW, RW, BIND = enums.IBV_ACCESS_LOCAL_WRITE, enums.IBV_ACCESS_REMOTE_WRITE, enums.IBV_ACCESS_MW_BIND
SIZE = 4096


def addr(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def poll(cq: CQ, n: int = 1, within: float = 10.0) -> list:
    """Poll until `n` completions arrived (bounded)."""
    got, deadline = [], time.monotonic() + within
    while len(got) < n and time.monotonic() < deadline:
        got += cq.poll(n - len(got))[1]
        time.sleep(0.001)
    return got


def new_qp(pd: PD, cq: CQ, max_send_wr: int = 32, sq_sig_all: int = 0) -> QP:
    cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
    return QP(pd, QPInitAttr(qp_type=enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=sq_sig_all))


class Side:
    """One end: a PD, a CQ, a buffer registered as an MR, a QP."""

    def __init__(self, access: int, remote_access: int = LW | RW) -> None:
        self.ctx = Context()
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 64)
        self.buf = bytearray(SIZE)
        self.mr = MR(self.pd, SIZE, access, address=addr(self.buf))
        self.qp = new_qp(self.pd, self.cq)
        self.remote_access = remote_access

    def connect(self, peer: "Side") -> None:
        a = QPAttr()
        a.qp_access_flags = self.remote_access
        self.qp.to_init(a)
        a.dest_qp_num = peer.qp.qp_num
        self.qp.to_rtr(a)
        self.qp.to_rts(a)


@pytest.fixture
def pair():
    FABRIC.faults.write_delay_s, FABRIC.faults.drop_completions = 0.0, 0
    src, dst = Side(LW), Side(LW | RW | BIND)
    src.buf[:] = bytes(range(256)) * (SIZE // 256)
    src.connect(dst)
    dst.connect(src)
    yield src, dst
    FABRIC.faults.write_delay_s, FABRIC.faults.drop_completions = 0.0, 0
    for s in (src, dst):
        s.qp.close()


def reconnect(src: Side, dst: Side) -> None:
    """ERR -> RESET -> RTS on both ends (a class C error moves the responder's QP to ERR too)."""
    for side in (src, dst):
        side.qp.to_error()
        side.qp.modify(QPAttr(qp_state=enums.IBV_QPS_RESET))
    src.connect(dst)
    dst.connect(src)


def write(
    src: Side,
    rkey: int,
    remote: int,
    length: int = 256,
    wr_id: int = 1,
    signaled: bool = True,
    opcode: int = enums.IBV_WR_RDMA_WRITE,
    imm: int = 0,
) -> None:
    wr = SendWR(
        wr_id=wr_id,
        opcode=opcode,
        num_sge=1,
        sg=[SGE(addr(src.buf), length, src.mr.lkey)],
        send_flags=enums.IBV_SEND_SIGNALED if signaled else 0,
        imm_data=imm,
    )
    wr.set_wr_rdma(rkey, remote)
    src.qp.post_send(wr)


def test_registration_and_state_machine_rules():
    side = Side(LW)
    with pytest.raises(VerbsError, match="REMOTE_WRITE requires LOCAL_WRITE"):
        MR(side.pd, SIZE, RW, address=addr(side.buf))
    with pytest.raises(VerbsError, match="not in RTS"):
        side.qp.post_send(SendWR(opcode=enums.IBV_WR_LOCAL_INV))
    with pytest.raises(VerbsError, match="illegal transition"):
        side.qp.to_rts(QPAttr())
    side.qp.to_error()
    side.qp.modify(QPAttr(qp_state=enums.IBV_QPS_RESET))  # ERR -> RESET is the only way back
    side.qp.to_init(QPAttr())
    side.qp.close()


def test_write_lands_only_with_valid_key_bounds_and_access(pair):
    src, dst = pair
    write(src, dst.mr.rkey, addr(dst.buf) + 512, signaled=False, wr_id=1)
    write(src, dst.mr.rkey, addr(dst.buf) + 1024, wr_id=2)
    (wc,) = poll(src.cq)
    assert (wc.wr_id, wc.status, wc.byte_len) == (2, enums.IBV_WC_SUCCESS, 256)  # unsignaled success is silent
    assert dst.buf[512:768] == src.buf[:256] and dst.buf[1024:1280] == src.buf[:256]
    before = bytes(dst.buf)
    write(src, dst.mr.rkey, addr(dst.buf) + SIZE - 100, wr_id=3)  # crosses the end of the MR
    write(src, dst.mr.rkey, addr(dst.buf), wr_id=4)  # queued behind the error
    wcs = poll(src.cq, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(3, enums.IBV_WC_REM_ACCESS_ERR), (4, enums.IBV_WC_WR_FLUSH_ERR)]
    assert bytes(dst.buf) == before and src.qp.qp_state == enums.IBV_QPS_ERR
    assert dst.qp.qp_state == enums.IBV_QPS_ERR  # class C: the responder's QP goes to ERR as well


def test_mr_without_remote_write_refuses():
    src, dst = Side(LW), Side(LW)
    src.connect(dst)
    dst.connect(src)
    write(src, dst.mr.rkey, addr(dst.buf))
    assert poll(src.cq)[0].status == enums.IBV_WC_REM_ACCESS_ERR and dst.buf == bytearray(SIZE)


def test_responder_qp_without_remote_write_answers_invalid_request():
    """The QP's own access flags are checked before any key (a NAK "invalid request", class C)."""
    src, dst = Side(LW), Side(LW | RW, remote_access=LW)
    src.connect(dst)
    dst.connect(src)
    write(src, dst.mr.rkey, addr(dst.buf))
    assert poll(src.cq)[0].status == enums.IBV_WC_REM_INV_REQ_ERR and dst.buf == bytearray(SIZE)
    assert dst.qp.qp_state == enums.IBV_QPS_ERR


def _bind(dst: Side, mw: MW, start: int, length: int, wr_id: int = 9) -> tuple[int, int]:
    """(completion status, the window's new rkey: the bind WR's, as pyverbs gives it)."""
    wr = SendWR(wr_id=wr_id, opcode=enums.IBV_WR_BIND_MW, send_flags=enums.IBV_SEND_SIGNALED)
    wr.set_bind_wr(mw, MWBindInfo(dst.mr, addr(dst.buf) + start, length, RW))
    dst.qp.post_send(wr)
    return poll(dst.cq)[0].status, wr.rkey


def _invalidate(dst: Side, rkey: int, wr_id: int = 10) -> int:
    inv = SendWR(wr_id=wr_id, opcode=enums.IBV_WR_LOCAL_INV, send_flags=enums.IBV_SEND_SIGNALED)
    inv.imm_data = rkey  # pyverbs has no invalidate_rkey: it shares imm_data's union (rdma-core tests/test_mr.py)
    dst.qp.post_send(inv)
    return poll(dst.cq)[0].status


def test_type2_window_grants_its_range_through_its_qp_until_invalidated(pair):
    src, dst = pair
    mw = MW(dst.pd, enums.IBV_MW_TYPE_2)
    write(src, mw.rkey, addr(dst.buf))  # unbound window: nothing
    assert poll(src.cq)[0].status == enums.IBV_WC_REM_ACCESS_ERR
    reconnect(src, dst)
    status, key = _bind(dst, mw, 1024, 512)
    assert status == enums.IBV_WC_SUCCESS and key != mw.rkey  # type 2: the key is the WR's, the MW's stays
    write(src, mw.rkey, addr(dst.buf) + 1024, length=512)  # the MW object's (allocation) key: nothing
    assert poll(src.cq)[0].status == enums.IBV_WC_REM_ACCESS_ERR and dst.buf[1024:1536] == bytearray(512)
    reconnect(src, dst)
    write(src, key, addr(dst.buf) + 1024, length=512)
    assert poll(src.cq)[0].status == enums.IBV_WC_SUCCESS and dst.buf[1024:1536] == src.buf[:512]
    write(src, key, addr(dst.buf) + 1536, wr_id=5)  # just past the window
    assert poll(src.cq)[0].status == enums.IBV_WC_REM_ACCESS_ERR and dst.buf[1536:1792] == bytearray(256)
    reconnect(src, dst)
    assert _invalidate(dst, mw.rkey) == enums.IBV_WC_LOC_PROT_ERR  # not the bound key: refused (QP to ERR)
    reconnect(src, dst)
    # invalidate: the old rkey now names nothing; the window can be bound again
    stale = key
    assert _invalidate(dst, stale) == enums.IBV_WC_SUCCESS
    status, key = _bind(dst, mw, 0, 256)
    assert status == enums.IBV_WC_SUCCESS
    dst.buf[1024:1536] = bytes(512)
    write(src, stale, addr(dst.buf) + 1024)
    assert poll(src.cq)[0].status == enums.IBV_WC_REM_ACCESS_ERR and dst.buf[1024:1536] == bytearray(512)


def test_window_is_usable_only_through_the_qp_it_was_bound_on(pair):
    src, dst = pair
    mw = MW(dst.pd, enums.IBV_MW_TYPE_2)
    status, key = _bind(dst, mw, 0, 1024)
    assert status == enums.IBV_WC_SUCCESS
    other_src, other_dst = Side(LW), Side(LW | RW, remote_access=LW | RW)
    other_dst.pd, other_dst.qp = dst.pd, new_qp(dst.pd, dst.cq)  # same PD, another QP
    other_src.connect(other_dst)
    other_dst.connect(other_src)
    write(other_src, key, addr(dst.buf))
    assert poll(other_src.cq)[0].status == enums.IBV_WC_REM_ACCESS_ERR and dst.buf[:256] == bytearray(256)


def test_write_with_imm_needs_a_receive_and_delivers_the_immediate(pair):
    src, dst = pair
    write(src, dst.mr.rkey, addr(dst.buf), opcode=enums.IBV_WR_RDMA_WRITE_WITH_IMM, imm=7)
    assert poll(src.cq)[0].status == enums.IBV_WC_RNR_RETRY_EXC_ERR
    assert dst.qp.qp_state == enums.IBV_QPS_RTS  # class B: the responder's QP stays usable
    src.qp.modify(QPAttr(qp_state=enums.IBV_QPS_RESET))
    src.connect(dst)
    dst.qp.post_recv(RecvWR(wr_id=77, num_sge=1, sg=[SGE(addr(dst.buf), 64, dst.mr.lkey)]))
    write(src, dst.mr.rkey, addr(dst.buf), opcode=enums.IBV_WR_RDMA_WRITE_WITH_IMM, imm=0xBEEF, wr_id=8)
    wcs = poll(src.cq, 1) + poll(dst.cq, 1)
    assert {(w.wr_id, w.status, w.opcode, w.imm_data) for w in wcs} == {
        (8, 0, enums.IBV_WC_RDMA_WRITE, 0),
        (77, 0, enums.IBV_WC_RECV_RDMA_WITH_IMM, 0xBEEF),
    }


def test_fault_hooks_delay_drop_and_force_error(pair):
    src, dst = pair
    FABRIC.faults.write_delay_s = 0.3
    write(src, dst.mr.rkey, addr(dst.buf), wr_id=1)
    assert src.cq.poll(1)[0] == 0 and dst.buf[:4] == bytearray(4)  # posted, not yet executed
    assert poll(src.cq)[0].status == enums.IBV_WC_SUCCESS and dst.buf[:256] == src.buf[:256]
    FABRIC.faults.write_delay_s, FABRIC.faults.drop_completions = 0.0, 1
    write(src, dst.mr.rkey, addr(dst.buf), wr_id=2)
    write(src, dst.mr.rkey, addr(dst.buf), wr_id=3)
    assert [w.wr_id for w in poll(src.cq)] == [3]  # the completion of 2 was lost
    src.qp.to_error()
    write(src, dst.mr.rkey, addr(dst.buf), wr_id=4, signaled=False)
    assert [(w.wr_id, w.status) for w in poll(src.cq)] == [(4, enums.IBV_WC_WR_FLUSH_ERR)]


def chain(src: Side, dst: Side, n: int, signal_last_only: bool = True) -> SendWR:
    """`n` WRITEs of 16 bytes linked through next_wr (the list keeps them alive, as pyverbs needs)."""
    wrs = []
    for i in range(n):
        wr = SendWR(
            wr_id=i,
            opcode=enums.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[SGE(addr(src.buf), 16, src.mr.lkey)],
            send_flags=enums.IBV_SEND_SIGNALED if i == n - 1 or not signal_last_only else 0,
        )
        wr.set_wr_rdma(dst.mr.rkey, addr(dst.buf) + 16 * (i % 256))
        wrs.append(wr)
    for a, b in zip(wrs, wrs[1:]):
        a.next_wr = b
    src._keep = wrs  # type: ignore[attr-defined]
    return wrs[0]


def test_send_queue_holds_max_send_wr_until_a_completion_is_polled(pair):
    """A chain longer than the send queue is refused at the WR that does not fit (ENOMEM); slots come
    back only when a completion at or after them is polled, signaled or not."""
    src, dst = pair  # max_send_wr 32
    src.qp.post_send(chain(src, dst, 32))
    assert [w.wr_id for w in poll(src.cq)] == [31]  # polling the last one frees all 32 slots
    src.qp.post_send(chain(src, dst, 32))
    assert [w.wr_id for w in poll(src.cq)] == [31]
    with pytest.raises(VerbsError, match="ENOMEM"):
        src.qp.post_send(chain(src, dst, 40))
    # the 32 that fit ran, but the signaled WR was the 40th: no completion will ever free them
    assert poll(src.cq, within=0.3) == []
    with pytest.raises(VerbsError, match="ENOMEM"):
        src.qp.post_send(chain(src, dst, 1))


def test_unsignaled_work_fills_the_queue_until_something_is_polled():
    src, dst = Side(LW), Side(LW | RW)
    src.qp = new_qp(src.pd, src.cq, max_send_wr=4)
    src.connect(dst)
    dst.connect(src)
    src.qp.post_send(chain(src, dst, 4, signal_last_only=False))
    with pytest.raises(VerbsError, match="ENOMEM"):  # 4 completions queued, none polled: still full
        src.qp.post_send(chain(src, dst, 1))
    assert len(poll(src.cq, 4)) == 4
    src.qp.post_send(chain(src, dst, 1))
    assert len(poll(src.cq)) == 1  # done before the buffers go: the device writes registered memory


def test_qp_signals_every_wr_unless_sq_sig_all_is_off():
    """pyverbs' QPInitAttr defaults to sq_sig_all=1: every WR completes, whatever its send_flags."""
    src, dst = Side(LW), Side(LW | RW)
    src.qp = new_qp(src.pd, src.cq, sq_sig_all=1)
    src.connect(dst)
    dst.connect(src)
    src.qp.post_send(chain(src, dst, 5))
    assert [w.wr_id for w in poll(src.cq, 5)] == [0, 1, 2, 3, 4]


def test_cq_overrun_moves_its_qps_to_error():
    src, dst = Side(LW), Side(LW | RW)
    src.cq = CQ(src.ctx, 4)
    src.qp = new_qp(src.pd, src.cq, max_send_wr=16)
    src.connect(dst)
    dst.connect(src)
    src.qp.post_send(chain(src, dst, 6, signal_last_only=False))  # 6 completions for a 4-entry CQ
    deadline = time.monotonic() + 5
    while src.qp.qp_state != enums.IBV_QPS_ERR and time.monotonic() < deadline:
        time.sleep(0.005)
    assert src.cq.overrun and src.qp.qp_state == enums.IBV_QPS_ERR


def test_path_mtu_above_the_ports_active_mtu_is_refused():
    src, dst = Side(LW), Side(LW | RW)
    port = src.ctx.query_port(1)
    assert port.active_mtu == enums.IBV_MTU_1024 and port.link_layer == enums.IBV_LINK_LAYER_ETHERNET
    a = QPAttr()
    a.qp_access_flags = LW
    src.qp.to_init(a)
    a.dest_qp_num, a.path_mtu = dst.qp.qp_num, enums.IBV_MTU_4096  # hard-coded 4096: not this port
    with pytest.raises(VerbsError, match="path MTU"):
        src.qp.to_rtr(a)
    a.path_mtu = port.active_mtu
    src.qp.to_rtr(a)
