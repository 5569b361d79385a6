"""Limits a NIC enforces, on the emulated device (with pyverbs' own parameter classes where pyverbs
imports, stand-ins with its refusals otherwise): a type-2 window's stale key lands nothing, a chain
longer than the send queue is refused at post while `run_chain` posts it in pieces, and a grant of
80 layers x 16 runs (1,280 windows) binds and lands every block."""

from __future__ import annotations

import pytest

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion, PoolGeometry, SessionCredentials
from pdserve.cachestore import rdma_verbs, verbs_emu
from pdserve.cachestore.verbs_emu import enums as emu_enums
from tests.cachestore.helpers import SECRET, block, pools
from tests.cachestore.test_verbs_emu import LW, RW, Side, _bind, addr, poll, reconnect, write

GID_STR = "fe80:0000:0000:0000:7f00:0001:9c41:0001"


def test_calls_real_pyverbs_refuses_are_refused():
    with pytest.raises(TypeError):
        verbs_emu.GlobalRoute(dgid=GID_STR, sgid_index=0)
    verbs_emu.GlobalRoute(dgid=verbs_emu.GID(GID_STR), sgid_index=0)
    wr = verbs_emu.SendWR(opcode=emu_enums.IBV_WR_LOCAL_INV)
    with pytest.raises(AttributeError):
        wr.set_next_wr(wr)  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        wr.invalidate_rkey = 5  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="SGE"):
        verbs_emu.SendWR(opcode=emu_enums.IBV_WR_RDMA_WRITE)
    assert wr.send_flags == emu_enums.IBV_SEND_SIGNALED  # pyverbs' default


def test_a_windows_stale_rkey_lands_nothing_and_the_bind_wrs_key_lands():
    src, dst = Side(LW), Side(LW | RW | emu_enums.IBV_ACCESS_MW_BIND)
    src.buf[:] = bytes(range(256)) * 16
    src.connect(dst)
    dst.connect(src)
    mw = verbs_emu.MW(dst.pd, emu_enums.IBV_MW_TYPE_2)
    status, key = _bind(dst, mw, 0, 1024)
    assert status == 0 and key != mw.rkey
    write(src, mw.rkey, addr(dst.buf))  # the MW object's key, as the old code read it
    assert poll(src.cq)[0].status == emu_enums.IBV_WC_REM_ACCESS_ERR and dst.buf[:256] == bytearray(256)
    reconnect(src, dst)
    write(src, key, addr(dst.buf))
    assert poll(src.cq)[0].status == 0 and dst.buf[:256] == src.buf[:256]
    for side in (src, dst):
        side.qp.close()


def test_a_300_wr_chain_overflows_the_send_queue_but_run_chain_posts_it_in_pieces(monkeypatch):
    monkeypatch.setenv(rdma_verbs.EMULATOR_ENV, "1")
    buf = bytearray(1 << 16)
    res = rdma_verbs.RdmaResources(verbs_emu.DEVICE_NAME, MemoryRegion.from_buffer(buf))
    res_peer = rdma_verbs.RdmaResources(verbs_emu.DEVICE_NAME, MemoryRegion.from_buffer(bytearray(1 << 16)))
    qp, cq = res.create_qp()
    peer, _ = res_peer.create_qp()
    try:
        res.connect(qp, res_peer.local_info(peer), responder=False)
        res_peer.connect(peer, res.local_info(qp), responder=True)
        v = res.v
        with pytest.raises(verbs_emu.VerbsError, match="ENOMEM"):  # the old code: one chain, one post
            wrs = [v.SendWR(opcode=v.enums.IBV_WR_LOCAL_INV, send_flags=0) for _ in range(300)]
            for a, b in zip(wrs, wrs[1:]):
                a.next_wr = b
            qp.post_send(wrs[0])
    finally:
        qp.close()
        peer.close()
        res.close()
        res_peer.close()
    # a fresh QP: the refused chain's WRs fill the old one's queue, as they would a NIC's
    res = rdma_verbs.RdmaResources(verbs_emu.DEVICE_NAME, MemoryRegion.from_buffer(buf), mw_bind=True)
    qp, cq = res.create_qp()
    res.connect(qp, res.local_info(qp), responder=True)  # loopback RC QP: binds need RTS only
    try:
        mws = [v.MW(res.pd, v.enums.IBV_MW_TYPE_2) for _ in range(300)]
        wrs = []
        for i, mw in enumerate(mws):
            wr = v.SendWR(wr_id=i + 1, opcode=v.enums.IBV_WR_BIND_MW, send_flags=0)
            wr.set_bind_wr(mw, v.MWBindInfo(res.mr, res.address + 64 * i, 64, v.enums.IBV_ACCESS_REMOTE_WRITE))
            wrs.append(wr)
        res.run_chain(qp, cq, wrs, timeout=10)
        assert len({wr.rkey for wr in wrs}) == 300 and all(m.bound is not None for m in mws)
    finally:
        qp.close()
        res.close()


async def test_an_80_layer_16_run_grant_lands_every_block(monkeypatch):
    """1,280 windows in one grant (80 layers x 16 runs): bound in send-queue-sized pieces."""
    monkeypatch.setenv(rdma_verbs.EMULATOR_ENV, "1")
    monkeypatch.setenv("PDSERVE_RDMA_QPS", "1")
    geo = PoolGeometry(num_layers=80, num_blocks=64, block_bytes=128)
    src, dst = pools(geo)
    server = CacheStoreServer(MemoryRegion.from_buffer(dst), geo, transport="rdma", secret=SECRET)
    await server.start()
    client = CacheStoreClient(MemoryRegion.from_buffer(src), geo, transport="rdma", secret=SECRET)
    dst_blocks = [b for run in range(16) for b in (4 * run, 4 * run + 1)]  # 16 runs of 2
    src_blocks = list(range(32))
    try:
        assert server._rdma is not None and server._rdma.use_mw
        creds = server.open_session("big", dst_blocks, geo.num_layers, timeout=60)
        tx = client.open_transfer(SessionCredentials.from_bytes(creds.to_bytes()))
        for layer in range(geo.num_layers):
            tx.write_layer(layer, src_blocks)
        await tx.finish(60)
        for layer in (0, 41, 79):
            for s, d in zip(src_blocks, dst_blocks):
                assert block(dst, geo, layer, d) == block(src, geo, layer, s)
        session = server.get_session("big")
        assert session is not None and len(session.grants()) == 1
        server.close_session("big")
        await session.wait_safe_to_reuse(20)
    finally:
        await client.close()
        await server.stop()
