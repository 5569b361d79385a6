"""RC queue-pair logic of the rdma transport, pure (no verbs call): what each side tells the other,
the state order, and the attribute values for each transition (`rdma_verbs.RdmaResources.connect`
fills pyverbs' QPAttr with them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class QpInfo:
    """What each side of an RC connection tells the other (over the TCP control channel)."""

    qp_num: int
    lid: int
    gid: str
    """The GID as pyverbs prints it (8 groups of 4 hex digits; RoCE needs it, IB can use the LID).
    On the wire a string; a `GID` object again (`v.GID(gid)`) where pyverbs takes one."""
    psn: int = 0
    mtu: int = 0
    """The sender's port's active MTU (enum ibv_mtu); the path uses the smaller of both ends'."""


class QpState(enum.IntEnum):
    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    ERROR = 4


_NEXT = {QpState.RESET: QpState.INIT, QpState.INIT: QpState.RTR, QpState.RTR: QpState.RTS}


def next_state(state: QpState, target: QpState) -> QpState:
    """RC QPs go RESET -> INIT -> RTR -> RTS in order; any state may drop to ERROR."""
    if target == QpState.ERROR or _NEXT.get(state) == target:
        return target
    raise ValueError(f"illegal QP transition {state.name} -> {target.name}")


def qp_attr_values(
    state: QpState,
    remote: QpInfo | None,
    *,
    port: int = 1,
    gid_index: int = 0,
    mtu: int = 3,
    max_rd_atomic: int = 1,
    hop_limit: int = 1,
) -> dict:
    """Attribute values for modify_qp into `state` (pure: what QPAttr is filled with)."""
    if state == QpState.INIT:
        # remote write is all the receiver's MR needs; local write for the sender's own MR
        return {
            "qp_state": "INIT",
            "pkey_index": 0,
            "port_num": port,
            "qp_access_flags": ("LOCAL_WRITE", "REMOTE_WRITE"),
        }
    if state == QpState.RTR:
        assert remote is not None, "RTR needs the peer's QP info"
        return {
            "qp_state": "RTR",
            "path_mtu": mtu,
            "dest_qp_num": remote.qp_num,
            "rq_psn": remote.psn,
            "max_dest_rd_atomic": max_rd_atomic,
            "min_rnr_timer": 12,
            "ah": {
                "dlid": remote.lid,
                "port_num": port,
                "is_global": bool(remote.gid),
                "dgid": remote.gid,
                "sgid_index": gid_index,
                "hop_limit": hop_limit,
            },
        }
    if state == QpState.RTS:
        return {
            "qp_state": "RTS",
            "sq_psn": 0,
            "timeout": 14,
            "retry_cnt": 7,
            "rnr_retry": 7,
            "max_rd_atomic": max_rd_atomic,
        }
    raise ValueError(f"no attributes for {state.name}")
