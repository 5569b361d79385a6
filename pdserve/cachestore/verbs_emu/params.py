"""The verbs parameter objects the emulated device takes: pyverbs' own classes when pyverbs imports
(Debian's python3-pyverbs builds them without a device: `scripts/install_pyverbs.sh`), so a call
that real pyverbs refuses (a str GID, `set_next_wr`, an unknown attribute, a WR without an SGE)
is refused here too; pure-Python stand-ins with the same signatures, defaults and refusals otherwise.

Only what the emulated device must read back and pyverbs 44 does not expose is added, in subclasses
with `__slots__` (so no attribute pyverbs lacks can be set): a work request's SGEs, its next WR, its
RDMA target, its window binding. `QPInitAttr` also takes emulated CQs (pyverbs wants its own), and
`SendWR.set_bind_wr` takes the emulated MW/MWBindInfo; the new rkey is computed as pyverbs does
(`inc_rkey` of the window's rkey) and read from the WR (`wr.rkey`), as on hardware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.cachestore.verbs_emu import enums
from pdserve.cachestore.verbs_emu.completion import CQ


def inc_rkey(rkey: int) -> int:
    """The next key of a window (pyverbs' inc_rkey: the low 8 bits, the consumer key, plus one)."""
    return (rkey & ~0xFF) | ((rkey + 1) & 0xFF)


def _check_cqs(*cqs) -> None:
    for cq in cqs:
        if cq is not None and not isinstance(cq, CQ):
            raise TypeError(f"expected an emulated CQ, got {type(cq).__name__}")


if TYPE_CHECKING:  # the stand-ins type the real classes too (pyverbs ships no stubs)
    from pdserve.cachestore.verbs_emu.standins import GID, SGE, AHAttr, GlobalRoute, QPAttr, QPCap, RecvWR
    from pdserve.cachestore.verbs_emu.standins import QPInitAttr as _InitBase
    from pdserve.cachestore.verbs_emu.standins import SendWR as _WRBase

    REAL_PYVERBS: bool
else:
    try:
        from pyverbs import addr as _addr
        from pyverbs import qp as _qp
        from pyverbs import wr as _wr
    except ImportError:
        REAL_PYVERBS = False
        from pdserve.cachestore.verbs_emu.standins import GID, SGE, AHAttr, GlobalRoute, QPAttr, QPCap, RecvWR
        from pdserve.cachestore.verbs_emu.standins import QPInitAttr as _InitBase
        from pdserve.cachestore.verbs_emu.standins import SendWR as _WRBase
    else:
        REAL_PYVERBS = True
        GID, GlobalRoute, AHAttr = _addr.GID, _addr.GlobalRoute, _addr.AHAttr
        SGE, RecvWR, QPCap, QPAttr = _wr.SGE, _wr.RecvWR, _qp.QPCap, _qp.QPAttr
        _WRBase, _InitBase = _wr.SendWR, _qp.QPInitAttr


class SendWR(_WRBase):
    """pyverbs.wr.SendWR (signature, defaults and refusals), plus what the emulated QP reads back
    (see the module docstring)."""

    __slots__ = ("_sges", "_next", "_rdma", "_bind", "_bind_rkey")

    def __init__(
        self,
        wr_id: int = 0,
        opcode: int = enums.IBV_WR_SEND,
        num_sge: int = 0,
        imm_data: int = 0,
        sg=None,
        send_flags: int = enums.IBV_SEND_SIGNALED,
        next_wr=None,
    ) -> None:
        super().__init__(
            wr_id=wr_id,
            opcode=opcode,
            num_sge=num_sge,
            imm_data=imm_data,
            sg=sg,
            send_flags=send_flags,
            next_wr=next_wr,
        )
        self._sges = [(int(s.addr), int(s.length), int(s.lkey)) for s in list(sg or [])[:num_sge]]
        self._next: SendWR | None = next_wr
        self._rdma = (0, 0)
        self._bind: tuple[Any, Any] | None = None
        self._bind_rkey = 0

    @property
    def next_wr(self):
        return self._next

    @next_wr.setter
    def next_wr(self, wr) -> None:
        _WRBase.next_wr.__set__(self, wr)  # pyverbs' own check: a SendWR, never None
        self._next = wr

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        super().set_wr_rdma(rkey, addr)
        self._rdma = (int(rkey), int(addr))

    def set_bind_wr(self, mw, bind_info) -> None:
        """As pyverbs: the WR will bind `mw` with the next key of its rkey (`inc_rkey`), read as `rkey`."""
        from pdserve.cachestore.verbs_emu.memory import MW, MWBindInfo  # memory imports nothing of this module

        if not isinstance(mw, MW) or not isinstance(bind_info, MWBindInfo):
            raise TypeError("set_bind_wr() takes an MW and an MWBindInfo")
        self._bind, self._bind_rkey = (mw, bind_info), inc_rkey(mw.rkey)

    @property
    def rkey(self) -> int:
        """The key a BIND_MW gives the window (the MW object's rkey stays the allocation key)."""
        return self._bind_rkey


class QPInitAttr(_InitBase):
    """pyverbs.qp.QPInitAttr (defaults: UD, every WR signaled), taking the emulated CQs."""

    __slots__ = ("scq", "rcq")

    def __init__(
        self, qp_type=enums.IBV_QPT_UD, qp_context=None, scq=None, rcq=None, srq=None, cap=None, sq_sig_all=1
    ) -> None:
        _check_cqs(scq, rcq)
        if srq is not None:
            raise TypeError("the emulated device has no SRQs")
        super().__init__(qp_type=qp_type, qp_context=qp_context, cap=cap, sq_sig_all=sq_sig_all)
        if cap is not None:  # pyverbs copies the caps only into an exact QPInitAttr (`type(dst) ==`)
            for name in ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge"):
                setattr(self, name, getattr(cap, name))
        self.scq, self.rcq = scq, rcq


__all__ = ["AHAttr", "GID", "GlobalRoute", "QPAttr", "QPCap", "QPInitAttr", "REAL_PYVERBS", "RecvWR", "SGE", "SendWR"]
