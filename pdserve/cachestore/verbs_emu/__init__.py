"""An emulated RDMA verbs device for CI machines that have no RDMA NIC, in one process or across
processes on one host (like soft-RoCE, but over loopback sockets: `verbs_emu.wire`).

EMULATED: it proves the logic of code written against verbs (key checks, QP states, ACK/NAK,
completions, fencing), not a NIC: there is no DMA engine, no PCIe, no GPUDirect, and its timings say
nothing about a NIC's. It follows the verbs specification, not pdserve's code; where the two
disagree the emulation wins and pdserve's code gets fixed. Only the device objects are emulated
(Context, PD, CQ, QP, MR, MW, MWBindInfo); the parameter objects (GID, GlobalRoute, AHAttr, SGE,
SendWR, QPCap, QPAttr, QPInitAttr) are pyverbs' own when it imports (`params`), so code passes
the emulator only with the argument types, defaults and attributes real pyverbs takes. The API is
the subset of pyverbs' names that an RC RDMA-WRITE transport needs:

    ctx = Context(DEVICE_NAME); pd = PD(ctx); cq = CQ(ctx, 64)
    mr = MR(pd, length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND, address=addr)
    mw = MW(pd, IBV_MW_TYPE_2)                 # bound by a BIND_MW WR (its key: wr.rkey), LOCAL_INV
    qp = QP(pd, QPInitAttr(qp_type=IBV_QPT_RC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=..), sq_sig_all=0))
    qp.to_init(..); qp.to_rtr(..); qp.to_rts(..)
    qp.post_send(SendWR(...)); cq.poll(16)

A QP whose RTR address handle carries the peer's GID (`ctx.query_gid(1, 0)`, which encodes this
process's device endpoint) sends its WRITEs as packets over a socket to the peer's process, whose
device thread checks and answers them (`verbs_emu.wire`). A QP moved to RTR without a GID reaches
a QP of this process by number (in-process path, used by the unit tests of the verbs rules).

Fault hooks (`FABRIC.faults`, also from $PDSERVE_RDMA_EMU_WRITE_DELAY_S /
$PDSERVE_RDMA_EMU_DROP_COMPLETIONS in a child process; `QP.to_error`): lose completions, delay
WRITEs, force a QP to ERR. Not emulated: RDMA READ, atomics, SEND/RECV payloads, type-1 windows,
UD/UC QPs, SRQs, path migration, packet loss, retransmission timers and retry counts (an unreachable
or silent responder fails with RETRY_EXC_ERR when its connection closes or after `wire.ACK_TIMEOUT`;
an RNR NAK fails at once with RNR_RETRY_EXC_ERR).
"""

from __future__ import annotations

from pdserve.cachestore.verbs_emu import enums
from pdserve.cachestore.verbs_emu.completion import CQ, WC
from pdserve.cachestore.verbs_emu.device import DEVICE_NAME, FABRIC, Context, Fabric, FaultHooks, get_device_list
from pdserve.cachestore.verbs_emu.memory import MR, MW, PD, MWBindInfo, VerbsError
from pdserve.cachestore.verbs_emu.params import (
    GID,
    REAL_PYVERBS,
    SGE,
    AHAttr,
    GlobalRoute,
    QPAttr,
    QPCap,
    QPInitAttr,
    RecvWR,
    SendWR,
)
from pdserve.cachestore.verbs_emu.queues import QP

EMULATED = True
"""Marks this verbs provider as the emulation (no peer-memory client: CUDA pools are staged)."""

__all__ = [
    "EMULATED",
    "AHAttr",
    "CQ",
    "Context",
    "DEVICE_NAME",
    "FABRIC",
    "Fabric",
    "FaultHooks",
    "GID",
    "GlobalRoute",
    "MR",
    "MW",
    "MWBindInfo",
    "PD",
    "QP",
    "QPAttr",
    "QPCap",
    "QPInitAttr",
    "REAL_PYVERBS",
    "RecvWR",
    "SGE",
    "SendWR",
    "VerbsError",
    "WC",
    "enums",
    "get_device_list",
]
