"""Pure parts of the RDMA transport (the verbs calls cannot run here: no RDMA in the kernel)."""

from __future__ import annotations

import pytest

from pdserve.cachestore import PoolGeometry, Run, resolve_transport
from pdserve.cachestore.rdma import QpInfo, QpState, next_state, plan_writes, qp_attr_values, rdma_devices


def test_no_device_here_and_auto_falls_back_to_tcp(caplog):
    assert rdma_devices() == []
    with caplog.at_level("WARNING"):
        assert resolve_transport("auto") == "tcp"
    assert "falling back to tcp" in caplog.text
    with pytest.raises(ValueError, match="no RDMA device"):
        resolve_transport("rdma")
    with pytest.raises(ValueError, match="transport must be"):
        resolve_transport("udp")


def test_remote_address_arithmetic_and_batching():
    local = PoolGeometry(2, 10, 256)
    remote = PoolGeometry(2, 40, 256)
    runs = [Run(1, 5, 3), Run(7, 30, 1)]
    batches = plan_writes(1, runs, local, 0x1000, remote, 0x900000, first_wr_id=5, max_per_post=1)
    assert len(batches) == 2
    w0, w1 = batches[0][0], batches[1][0]
    assert w0.local_addr == 0x1000 + (1 * 10 + 1) * 256 and w0.length == 3 * 256
    assert w0.remote_addr == 0x900000 + (1 * 40 + 5) * 256 and w0.wr_id == 5
    assert w1.remote_addr == 0x900000 + (40 + 30) * 256 and w1.length == 256
    assert len(plan_writes(0, runs * 40, local, 0, remote, 0)[0]) == 32


def test_qp_state_machine_and_attributes():
    s = QpState.RESET
    for target in (QpState.INIT, QpState.RTR, QpState.RTS):
        s = next_state(s, target)
    assert s == QpState.RTS
    with pytest.raises(ValueError, match="illegal"):
        next_state(QpState.RESET, QpState.RTS)
    assert next_state(QpState.RTR, QpState.ERROR) == QpState.ERROR
    peer = QpInfo(qp_num=77, lid=3, gid="fe80::1", psn=9)
    rtr = qp_attr_values(QpState.RTR, peer)
    assert rtr["dest_qp_num"] == 77 and rtr["rq_psn"] == 9 and rtr["ah"]["dlid"] == 3 and rtr["ah"]["is_global"]
    assert "REMOTE_WRITE" in qp_attr_values(QpState.INIT, None)["qp_access_flags"]
    assert qp_attr_values(QpState.RTS, None)["retry_cnt"] == 7


def test_a_write_goes_only_under_a_granted_window_that_covers_it():
    from pdserve.cachestore.rdma import window_for

    windows = [[1000, 512, 0x1201], [4096, 1024, 0x1302]]
    assert window_for(windows, 1000, 512) == 0x1201 and window_for(windows, 4096 + 512, 512) == 0x1302
    with pytest.raises(OSError, match="no granted window"):
        window_for(windows, 1000, 513)  # one byte past the range: the sender refuses to post it
