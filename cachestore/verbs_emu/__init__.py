"""An emulated RDMA verbs device, in-process, for CI machines that have no RDMA NIC.

EMULATED: it proves the logic of code written against verbs (key checks, QP states, completions,
fencing), not a NIC: there is no wire, no DMA engine, no PCIe and no GPUDirect. It follows the verbs
specification, not pdserve's code; where the two disagree the emulation is meant to win. The API is
the subset of pyverbs' names that an RC RDMA-WRITE transport needs:

    ctx = Context(DEVICE_NAME); pd = PD(ctx); cq = CQ(ctx, 64)
    mr = MR(pd, length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND, address=addr)
    mw = MW(pd, IBV_MW_TYPE_2)                 # bound by a BIND_MW work request, then LOCAL_INV
    qp = QP(pd, QPInitAttr(scq=cq, rcq=cq)); qp.to_init(..); qp.to_rtr(..); qp.to_rts(..)
    qp.post_send(SendWR(...)); cq.poll(16)

Fault hooks (`FABRIC.faults`, `QP.to_error`): lose completions, delay WRITEs, force a QP to ERR.
Not emulated: RDMA READ, atomics, SEND/RECV payloads, type-1 windows, UD/UC QPs, SRQs, path
migration, timeouts and retry counts (a missing responder fails at once with RETRY_EXC_ERR).
"""

from __future__ import annotations

from cachestore.verbs_emu import enums
from cachestore.verbs_emu.device import (DEVICE_NAME, FABRIC, AHAttr, Context, Fabric, FaultHooks, GlobalRoute,
                                        get_device_list)
from cachestore.verbs_emu.memory import MR, MW, PD, MWBindInfo, VerbsError
from cachestore.verbs_emu.queues import CQ, QP, WC, QPAttr, QPCap, QPInitAttr, RecvWR, SendWR, SGE

__all__ = ["AHAttr", "CQ", "Context", "DEVICE_NAME", "FABRIC", "Fabric", "FaultHooks", "GlobalRoute", "MR", "MW", "MWBindInfo", "PD", "QP",
           "QPAttr", "QPCap", "QPInitAttr", "RecvWR", "SGE", "SendWR", "VerbsError", "WC", "enums",
           "get_device_list"]
