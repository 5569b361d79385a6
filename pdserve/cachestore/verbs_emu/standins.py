"""Stand-ins for pyverbs' parameter classes where pyverbs is not installed (`params` prefers the
real ones). Same constructors, defaults and refusals as pyverbs 44 (rdma-core's pyverbs/addr.pyx,
qp.pyx, wr.pyx): a GID is a full 8-group string, a GlobalRoute takes only a GID, a SendWR without an
SGE is refused unless it is a window operation, work requests are signaled by default and chained
through `next_wr`, QPs signal every WR unless sq_sig_all=0, and no attribute outside pyverbs' own
can be set (`__slots__`)."""

from __future__ import annotations

from pdserve.cachestore.verbs_emu import enums


class PyverbsUserError(ValueError):
    """What pyverbs raises for a malformed parameter."""


class GID:
    """pyverbs.addr.GID: 16 bytes written as 8 groups of 4 hex digits."""

    __slots__ = ("_gid",)

    def __init__(self, val: str | None = None) -> None:
        self._gid = "0000:" * 7 + "0000"
        if val is not None:
            self.gid = val

    @property
    def gid(self) -> str:
        return self._gid

    @gid.setter
    def gid(self, val: str) -> None:
        groups = str(val).split(":")
        if len(groups) != 8 or not all(1 <= len(g) <= 4 for g in groups):
            raise PyverbsUserError(f"Invalid GID value ({groups})")
        self._gid = ":".join(f"{int(g, 16):04x}" for g in groups)

    def __str__(self) -> str:
        return self._gid


class GlobalRoute:
    """pyverbs.addr.GlobalRoute: the GRH of an address handle; `dgid` takes a GID, reads as a str."""

    __slots__ = ("_dgid", "flow_label", "sgid_index", "hop_limit", "traffic_class")

    def __init__(
        self, dgid: GID | None = None, flow_label: int = 0, sgid_index: int = 0, hop_limit: int = 1, traffic_class=0
    ) -> None:
        if dgid is not None and not isinstance(dgid, GID):
            raise TypeError(
                f"Argument 'dgid' has incorrect type (expected pyverbs.addr.GID, got {type(dgid).__name__})"
            )
        self._dgid = dgid.gid if dgid is not None else GID().gid
        self.flow_label, self.sgid_index, self.hop_limit, self.traffic_class = (
            flow_label,
            sgid_index,
            hop_limit,
            traffic_class,
        )

    @property
    def dgid(self) -> str:
        return self._dgid


class AHAttr:
    """pyverbs.addr.AHAttr: with a GlobalRoute (is_global), `dgid` and the GRH fields come from it."""

    __slots__ = (
        "dlid",
        "sl",
        "src_path_bits",
        "static_rate",
        "is_global",
        "port_num",
        "dgid",
        "sgid_index",
        "hop_limit",
    )

    def __init__(
        self, dlid=0, sl=0, src_path_bits=0, static_rate=0, is_global=0, port_num=1, gr: GlobalRoute | None = None
    ) -> None:
        if gr is not None and not isinstance(gr, GlobalRoute):
            raise TypeError(f"Argument 'gr' has incorrect type (expected GlobalRoute, got {type(gr).__name__})")
        self.dlid, self.sl, self.src_path_bits, self.static_rate = dlid, sl, src_path_bits, static_rate
        self.is_global, self.port_num = is_global, port_num
        self.dgid = gr.dgid if gr is not None else GID().gid
        self.sgid_index, self.hop_limit = (gr.sgid_index, gr.hop_limit) if gr is not None else (0, 0)


class SGE:
    """pyverbs.wr.SGE."""

    __slots__ = ("addr", "length", "lkey")

    def __init__(self, addr: int, length: int, lkey: int) -> None:
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    """pyverbs.wr.SendWR's fields and checks (`params.SendWR` adds what the emulated QP reads)."""

    __slots__ = ("wr_id", "opcode", "num_sge", "imm_data", "send_flags", "_sg")

    def __init__(
        self,
        wr_id=0,
        opcode=enums.IBV_WR_SEND,
        num_sge=0,
        imm_data=0,
        sg=None,
        send_flags=enums.IBV_SEND_SIGNALED,
        next_wr=None,
    ) -> None:
        if opcode not in (enums.IBV_WR_LOCAL_INV, enums.IBV_WR_BIND_MW, enums.IBV_WR_SEND_WITH_INV) and (
            num_sge < 1 or sg is None
        ):
            raise PyverbsUserError("A WR needs at least one SGE")
        if next_wr is not None and not isinstance(next_wr, SendWR):
            raise TypeError("Argument 'next_wr' has incorrect type (expected SendWR)")
        self.wr_id, self.opcode, self.num_sge, self.imm_data, self.send_flags = (
            wr_id,
            opcode,
            num_sge,
            imm_data,
            send_flags,
        )
        self._sg = list(sg or [])[:num_sge]

    def _set_next(self, wr) -> None:
        if not isinstance(wr, SendWR):
            raise TypeError(f"Argument 'val' has incorrect type (expected SendWR, got {type(wr).__name__})")

    next_wr = property(None, _set_next, doc="Write-only here: params.SendWR keeps the chain.")

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        """Recorded by params.SendWR."""


class RecvWR:
    """pyverbs.wr.RecvWR."""

    __slots__ = ("wr_id", "num_sge", "_sg")

    def __init__(self, wr_id=0, num_sge=0, sg=None, next_wr=None) -> None:
        if num_sge < 1 or sg is None:
            raise PyverbsUserError("A WR needs at least one SGE")
        self.wr_id, self.num_sge, self._sg = wr_id, num_sge, sg


class QPCap:
    """pyverbs.qp.QPCap (its defaults)."""

    __slots__ = ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge", "max_inline_data")

    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0) -> None:
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr
        self.max_send_sge, self.max_recv_sge, self.max_inline_data = max_send_sge, max_recv_sge, max_inline_data


def _cap_field(name: str) -> property:
    """A QPInitAttr field that pyverbs keeps in its inner ibv_qp_cap: read and written through `cap`."""
    return property(lambda self: getattr(self.cap, name), lambda self, val: setattr(self.cap, name, val))


class QPInitAttr:
    """pyverbs.qp.QPInitAttr: a UD QP that signals every WR unless told otherwise."""

    __slots__ = ("qp_type", "qp_context", "cap", "sq_sig_all")

    def __init__(self, qp_type=enums.IBV_QPT_UD, qp_context=None, cap: QPCap | None = None, sq_sig_all=1) -> None:
        if cap is not None and not isinstance(cap, QPCap):
            raise TypeError("Argument 'cap' has incorrect type (expected QPCap)")
        self.qp_type, self.qp_context, self.cap, self.sq_sig_all = qp_type, qp_context, cap or QPCap(), sq_sig_all

    max_send_wr = _cap_field("max_send_wr")
    max_recv_wr = _cap_field("max_recv_wr")
    max_send_sge = _cap_field("max_send_sge")
    max_recv_sge = _cap_field("max_recv_sge")


class QPAttr:
    """pyverbs.qp.QPAttr: the modify-QP attributes (only pyverbs' names can be set)."""

    __slots__ = (
        "qp_state", "cur_qp_state", "port_num", "qp_access_flags", "dest_qp_num", "rq_psn", "sq_psn", "path_mtu",
        "max_dest_rd_atomic", "max_rd_atomic", "min_rnr_timer", "timeout", "retry_cnt", "rnr_retry", "pkey_index",
        "qkey", "_ah_attr",
    )  # fmt: skip

    def __init__(self, qp_state=enums.IBV_QPS_INIT, cur_qp_state=enums.IBV_QPS_RESET, port_num=1) -> None:
        self.qp_state, self.cur_qp_state, self.port_num = qp_state, cur_qp_state, port_num
        self.qp_access_flags = self.dest_qp_num = self.rq_psn = self.sq_psn = self.pkey_index = self.qkey = 0
        self.max_dest_rd_atomic = self.max_rd_atomic = self.min_rnr_timer = 0
        self.timeout = self.retry_cnt = self.rnr_retry = 0
        self.path_mtu = enums.IBV_MTU_1024
        self._ah_attr = AHAttr()

    @property
    def ah_attr(self) -> AHAttr:
        return self._ah_attr

    @ah_attr.setter
    def ah_attr(self, val: AHAttr) -> None:
        if not isinstance(val, AHAttr):
            raise TypeError("Argument 'val' has incorrect type (expected AHAttr)")
        self._ah_attr = val
