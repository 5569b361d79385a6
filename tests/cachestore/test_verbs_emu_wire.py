"""The emulated verbs device across processes: RC WRITEs travel as packets over a loopback socket to
the responder's process, which checks rkey, bounds and access before a byte lands and answers with
an ACK or a NAK (EMULATED: proves verbs logic, not a NIC)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from pdserve.cachestore.verbs_emu import (
    CQ,
    GID,
    MR,
    MW,
    PD,
    QP,
    AHAttr,
    Context,
    GlobalRoute,
    MWBindInfo,
    QPAttr,
    SendWR,
)
from pdserve.cachestore.verbs_emu import enums
from pdserve.cachestore.verbs_emu import wire
from pdserve.cachestore.verbs_emu.device import FABRIC
from tests.cachestore.test_verbs_emu import BIND, LW, RW, SIZE, addr, new_qp, poll, write

CANARY = 0xA5


def connect(qp: QP, access: int, peer_qpn: int, peer_gid: str) -> None:
    """RESET -> INIT -> RTR (through the peer's emulated GID) -> RTS, as rdma_verbs does."""
    a = QPAttr()
    a.qp_access_flags = access
    qp.to_init(a)
    a.dest_qp_num = peer_qpn
    a.ah_attr = AHAttr(is_global=1, gr=GlobalRoute(dgid=GID(peer_gid)))
    qp.to_rtr(a)
    qp.to_rts(a)


def responder_process(conn) -> None:
    """Child: a registered canary buffer behind a QP; binds windows and reports its bytes on request."""
    ctx = Context()
    pd, cq = PD(ctx), CQ(ctx, 64)
    buf = bytearray([CANARY]) * SIZE
    mr = MR(pd, SIZE, LW | BIND, address=addr(buf))  # no remote access through the MR itself
    qp = new_qp(pd, cq)
    conn.send((qp.qp_num, str(ctx.query_gid(1, 0)), addr(buf)))
    peer_qpn, peer_gid = conn.recv()
    connect(qp, LW | RW, peer_qpn, peer_gid)
    windows: list[MW] = []
    while True:
        msg = conn.recv()
        if msg is None:
            return
        if msg[0] == "bind":
            mw = MW(pd, enums.IBV_MW_TYPE_2)
            wr = SendWR(wr_id=1, opcode=enums.IBV_WR_BIND_MW, send_flags=enums.IBV_SEND_SIGNALED)
            wr.set_bind_wr(mw, MWBindInfo(mr, addr(buf) + msg[1], msg[2], RW))
            qp.post_send(wr)
            assert poll(cq)[0].status == enums.IBV_WC_SUCCESS
            windows.append(mw)
            conn.send(wr.rkey)  # type 2: the bound key is the WR's
        elif msg[0] == "dealloc":
            for mw in windows:
                mw.close()
            conn.send(True)
        elif msg[0] == "dump":
            conn.send((bytes(buf), qp.qp_state))


class Requester:
    def __init__(self) -> None:
        self.ctx = Context()
        self.pd, self.cq = PD(self.ctx), CQ(self.ctx, 64)
        self.buf = bytearray(range(256)) * (SIZE // 256)
        self.mr = MR(self.pd, SIZE, LW, address=addr(self.buf))
        self.qp = new_qp(self.pd, self.cq)


@pytest.fixture
def remote():
    """(requester here, pipe to the responder process, its buffer address)."""
    FABRIC.faults.write_delay_s, FABRIC.faults.drop_completions = 0.0, 0
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=responder_process, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "responder process did not start"
        qpn, gid, base = parent.recv()
        assert wire.parse_gid(gid)[1] != FABRIC.endpoint().port  # another process, another endpoint
        req = Requester()
        parent.send((req.qp.qp_num, str(req.ctx.query_gid(1, 0))))
        connect(req.qp, LW, qpn, gid)
        yield req, parent, base
        req.qp.close()
        parent.send(None)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def ask(parent, *msg):
    parent.send(msg)
    assert parent.poll(30)
    return parent.recv()


def test_write_through_a_window_lands_in_the_other_process_and_a_stale_key_lands_nothing(remote):
    req, parent, base = remote
    rkey = ask(parent, "bind", 1024, 2048)
    write(req, rkey, base + 1024, length=2048, wr_id=1)  # inside the window
    (wc,) = poll(req.cq)
    assert (wc.wr_id, wc.status, wc.byte_len) == (1, enums.IBV_WC_SUCCESS, 2048)
    data, state = ask(parent, "dump")
    assert data[1024:3072] == req.buf[:2048] and data[:1024] == bytes([CANARY]) * 1024
    assert data[3072:] == bytes([CANARY]) * (SIZE - 3072)
    assert ask(parent, "dealloc")  # the session closed: the window is gone
    write(req, rkey, base + 1024, length=256, wr_id=2)  # the stale credential
    write(req, rkey, base + 1024, length=256, wr_id=3, signaled=False)  # queued behind: flushed
    wcs = poll(req.cq, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(2, enums.IBV_WC_REM_ACCESS_ERR), (3, enums.IBV_WC_WR_FLUSH_ERR)]
    assert req.qp.qp_state == enums.IBV_QPS_ERR
    after, state = ask(parent, "dump")
    assert after == data and state == enums.IBV_QPS_ERR  # nothing landed; class C moved the responder to ERR


def test_a_write_straddling_the_window_end_lands_nothing(remote):
    req, parent, base = remote
    rkey = ask(parent, "bind", 0, SIZE // 2)
    write(req, rkey, base + SIZE // 2 - 128, length=256, wr_id=7)  # straddles the window's end
    assert poll(req.cq)[0].status == enums.IBV_WC_REM_ACCESS_ERR
    data, _ = ask(parent, "dump")
    assert data == bytes([CANARY]) * SIZE  # checked against the RETH before any byte landed


def test_multi_packet_message_and_unreachable_responder(monkeypatch):
    """Same process, over the wire: a message of several packets lands whole; a peer endpoint that
    does not answer gives RETRY_EXC_ERR."""
    monkeypatch.setattr(wire, "MTU", 1000)
    a, b = Requester(), Requester()
    target = bytearray(SIZE)
    mr = MR(b.pd, SIZE, LW | RW, address=addr(target))
    gid = str(b.ctx.query_gid(1, 0))
    connect(a.qp, LW, b.qp.qp_num, gid)
    connect(b.qp, LW | RW, a.qp.qp_num, str(a.ctx.query_gid(1, 0)))
    write(a, mr.rkey, addr(target), length=SIZE, wr_id=5)
    assert poll(a.cq)[0].status == enums.IBV_WC_SUCCESS and target == a.buf
    c = Requester()
    connect(c.qp, LW, 0x7777, wire.make_gid("127.0.0.1", 1))  # nothing listens on port 1
    write(c, mr.rkey, addr(target), wr_id=6)
    assert poll(c.cq)[0].status == enums.IBV_WC_RETRY_EXC_ERR
    for qp in (a.qp, b.qp, c.qp):
        qp.close()


def test_gid_carries_the_endpoint():
    gid = wire.make_gid("127.0.0.1", 4791)
    assert wire.parse_gid(gid) == ("127.0.0.1", 4791)
    assert wire.parse_gid("fe80:0000:0000:0000:0000:0000:0000:0001") is None  # a non-emulated GID


def test_a_responder_qp_in_error_drops_packets_and_hooks_come_from_the_env(monkeypatch):
    a, b = Requester(), Requester()
    target = bytearray(SIZE)
    mr = MR(b.pd, SIZE, LW | RW, address=addr(target))
    connect(a.qp, LW, b.qp.qp_num, str(b.ctx.query_gid(1, 0)))
    connect(b.qp, LW | RW, a.qp.qp_num, str(a.ctx.query_gid(1, 0)))
    b.qp.to_error()  # fault hook on the responder's side: its packets are dropped, no NAK comes
    write(a, mr.rkey, addr(target), wr_id=9)
    assert poll(a.cq)[0].status == enums.IBV_WC_RETRY_EXC_ERR and target == bytearray(SIZE)
    for qp in (a.qp, b.qp):
        qp.close()
    monkeypatch.setenv("PDSERVE_RDMA_EMU_WRITE_DELAY_S", "0.25")
    monkeypatch.setenv("PDSERVE_RDMA_EMU_DROP_COMPLETIONS", "2")
    hooks = type(FABRIC.faults).from_env()  # what a node process's fabric starts with
    assert (hooks.write_delay_s, hooks.drop_completions) == (0.25, 2)
