"""The RDMA code's verbs calls against the real pyverbs module (Debian's python3-pyverbs, put on the
venv's path by scripts/install_pyverbs.sh; skipped where it is absent).

There is no RDMA device here, so the device objects (Context, PD, CQ, QP, MR, MW) cannot be made
for real; every parameter object the code builds can, and is: each constructor and attribute the
code uses is called here with the argument types the code passes, the names the code reads from
`verbs()` and `enums` must exist in pyverbs, and the emulated device (which takes pyverbs' own
parameter classes when pyverbs imports) runs the whole transport through them. Calls that fail on
hardware (a str GID, `set_next_wr`, `invalidate_rkey`, a window's stale rkey, a chain longer than
the send queue) must fail here too; the emulator-level halves of those (a stale window key, a
300-WR chain, an 80-layer x 16-run grant) are in test_rdma_limits.py, which runs without pyverbs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pyverbs_wr = pytest.importorskip(
    "pyverbs.wr", reason="pyverbs not importable (scripts/install_pyverbs.sh)", exc_type=ImportError
)
from pyverbs import addr as pv_addr  # noqa: E402
from pyverbs import enums as pv_enums  # noqa: E402
from pyverbs import qp as pv_qp  # noqa: E402

from pdserve.cachestore import rdma_verbs, verbs_emu  # noqa: E402
from pdserve.cachestore.rdma_qp import QpInfo, QpState, qp_attr_values  # noqa: E402
from pdserve.cachestore.rdma_verbs import MAX_SEND_WR  # noqa: E402
from pdserve.cachestore.verbs_emu import enums as emu_enums  # noqa: E402

RDMA_FILES = ["rdma.py", "rdma_access.py", "rdma_memory.py", "rdma_verbs.py"]
GID_STR = "fe80:0000:0000:0000:7f00:0001:9c41:0001"


def rdma_sources() -> str:
    root = Path(__file__).resolve().parents[2] / "pdserve" / "cachestore"
    return "\n".join((root / name).read_text() for name in RDMA_FILES)


def test_the_emulator_builds_with_pyverbs_own_parameter_classes():
    assert verbs_emu.REAL_PYVERBS
    assert verbs_emu.GID is pv_addr.GID and verbs_emu.GlobalRoute is pv_addr.GlobalRoute
    assert verbs_emu.AHAttr is pv_addr.AHAttr and verbs_emu.SGE is pyverbs_wr.SGE
    assert verbs_emu.QPCap is pv_qp.QPCap and verbs_emu.QPAttr is pv_qp.QPAttr
    assert issubclass(verbs_emu.SendWR, pyverbs_wr.SendWR) and issubclass(verbs_emu.QPInitAttr, pv_qp.QPInitAttr)


def test_every_enum_the_code_reads_exists_in_pyverbs_with_the_emulators_value():
    names = set(re.findall(r"enums\.(IBV_\w+)", rdma_sources()))
    assert len(names) >= 12
    for name in sorted(names):
        assert hasattr(pv_enums, name), f"pyverbs.enums has no {name}"
        assert getattr(emu_enums, name) == getattr(pv_enums, name), name


def test_every_verbs_name_the_code_reads_exists_in_real_pyverbs(monkeypatch):
    """`v.X` in the RDMA code: each X is in the namespace `verbs()` builds from real pyverbs (and in
    the emulator's)."""
    monkeypatch.delenv(rdma_verbs.EMULATOR_ENV, raising=False)
    real = rdma_verbs.verbs()
    used = set()
    for node in ast.walk(ast.parse(rdma_sources())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "v":
            used.add(node.attr)
    assert {"SendWR", "SGE", "GID", "GlobalRoute", "AHAttr", "QPAttr", "QPCap", "QPInitAttr", "MW"} <= used
    for name in sorted(used):
        assert hasattr(real, name), f"verbs() has no {name}"
        assert hasattr(verbs_emu, name), f"the emulator has no {name}"


def test_each_parameter_object_as_the_code_builds_it():
    """The constructors and attributes of rdma_verbs / rdma / rdma_access, same argument types."""
    remote = QpInfo(qp_num=0x55, lid=0, gid=GID_STR, psn=0, mtu=pv_enums.IBV_MTU_1024)
    values = qp_attr_values(QpState.RTR, remote, port=1, gid_index=0, mtu=pv_enums.IBV_MTU_1024, hop_limit=64)
    ah = values["ah"]
    gr = pv_addr.GlobalRoute(dgid=pv_addr.GID(remote.gid), sgid_index=ah["sgid_index"], hop_limit=ah["hop_limit"])
    attr = pv_qp.QPAttr(port_num=1)
    attr.qp_access_flags = pv_enums.IBV_ACCESS_LOCAL_WRITE | pv_enums.IBV_ACCESS_REMOTE_WRITE
    attr.ah_attr = pv_addr.AHAttr(port_num=1, dlid=ah["dlid"], is_global=int(ah["is_global"]), gr=gr)
    attr.dest_qp_num, attr.rq_psn = values["dest_qp_num"], values["rq_psn"]
    attr.path_mtu, attr.max_dest_rd_atomic = values["path_mtu"], values["max_dest_rd_atomic"]
    attr.min_rnr_timer = values["min_rnr_timer"]
    for key, value in qp_attr_values(QpState.RTS, remote).items():
        if key != "qp_state":
            setattr(attr, key, value)
    assert attr.ah_attr.dgid == GID_STR and attr.ah_attr.is_global == 1 and attr.path_mtu == pv_enums.IBV_MTU_1024
    cap = pv_qp.QPCap(max_send_wr=MAX_SEND_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    init = pv_qp.QPInitAttr(qp_type=pv_enums.IBV_QPT_RC, cap=cap, sq_sig_all=0)
    assert (init.max_send_wr, init.sq_sig_all, init.qp_type) == (MAX_SEND_WR, 0, pv_enums.IBV_QPT_RC)
    assert pv_qp.QPInitAttr().sq_sig_all == 1  # pyverbs' default signals every WR: the code sets 0

    wrs = []
    for i in range(3):
        wr = pyverbs_wr.SendWR(
            wr_id=i,
            opcode=pv_enums.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[pyverbs_wr.SGE(0x1000 + 64 * i, 64, 0x1234)],
            send_flags=0,
        )
        wr.set_wr_rdma(0x5601, 0x9000)
        wrs.append(wr)
    for a, b in zip(wrs, wrs[1:]):
        a.next_wr = b
    wrs[-1].send_flags = pv_enums.IBV_SEND_SIGNALED
    assert pyverbs_wr.SendWR(opcode=pv_enums.IBV_WR_LOCAL_INV).send_flags == pv_enums.IBV_SEND_SIGNALED
    inv = pyverbs_wr.SendWR(opcode=pv_enums.IBV_WR_LOCAL_INV, send_flags=0)
    inv.imm_data = 0xABCDEF12  # LOCAL_INV's key (rdma-core tests/test_mr.py)
    assert inv.imm_data == 0xABCDEF12
    bind = pyverbs_wr.SendWR(opcode=pv_enums.IBV_WR_BIND_MW, send_flags=0)
    assert isinstance(bind.rkey, int)  # where a type-2 bind's key is read after post


def test_calls_that_fail_on_hardware_fail_here():
    with pytest.raises(TypeError, match="GID"):
        pv_addr.GlobalRoute(dgid=GID_STR, sgid_index=0)
    with pytest.raises(Exception, match="Invalid GID"):
        pv_addr.GID("fe80::7f00:1:9c41:1")  # the compressed form: not what pyverbs parses
    wr = verbs_emu.SendWR(wr_id=1, opcode=pv_enums.IBV_WR_RDMA_WRITE, num_sge=1, sg=[pyverbs_wr.SGE(1, 1, 1)])
    with pytest.raises(AttributeError):
        wr.set_next_wr(wr)  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        verbs_emu.SendWR(opcode=pv_enums.IBV_WR_LOCAL_INV).invalidate_rkey = 5  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="SGE"):
        pyverbs_wr.SendWR(opcode=pv_enums.IBV_WR_RDMA_WRITE)
    linked = pyverbs_wr.SendWR(num_sge=1, sg=[pyverbs_wr.SGE(1, 1, 1)])
    linked.next_wr = pyverbs_wr.SendWR(num_sge=1, sg=[pyverbs_wr.SGE(1, 1, 1)])
    with pytest.raises(Exception, match="SGE"):
        linked.next_wr  # noqa: B018  # pyverbs cannot read a chain back: the code never does
