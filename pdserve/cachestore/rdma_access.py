"""Receiver side of the rdma transport: per-connection responder QPs and per-session remote access.

The pool MR grants no remote access. A sender gets write access to exactly one session's blocks,
through exactly one of its QPs, by asking for a grant on the control channel (session id + token,
checked like a write header): the receiver binds one type-2 memory window per contiguous range of
the session's blocks (each layer's runs of consecutive ids) through the responder QP of that
connection and answers with the windows' addresses and rkeys. Where the device has no memory
windows, it registers one MR per range instead (`PDSERVE_RDMA_ACCESS=mr` forces that fallback).

When the session closes, every grant is revoked: LOCAL_INV of each window (or deregistration of
each MR), then deallocation. The revocation counts in `Session.wait_safe_to_reuse`, so the blocks
go back to the allocator only after no key can reach them; a sender's WRITE that runs later gets a
remote access error and lands nothing. NOT EXERCISED on hardware (see `cachestore.rdma_verbs`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict

from pdserve.cachestore import rdma_memory
from pdserve.cachestore.credentials import SessionCredentials
from pdserve.cachestore.geometry import PoolGeometry, block_runs
from pdserve.cachestore.rdma_qp import QpInfo
from pdserve.cachestore.rdma_verbs import RdmaResources

log = logging.getLogger("pdserve.cachestore")
ACCESS_ENV = "PDSERVE_RDMA_ACCESS"
REVOKE_TIMEOUT = 5.0
"""Seconds a LOCAL_INV may take before the window is deallocated anyway (deallocation also revokes)."""
BIND_TIMEOUT = 2.0
"""Seconds the binds of one grant may take (less than the sender's control socket timeout)."""


def session_ranges(geometry: PoolGeometry, creds: SessionCredentials, base: int) -> list[tuple[int, int]]:
    """(address, length) of every contiguous byte range the session owns: per layer, per run of ids."""
    runs = block_runs(sorted(creds.block_ids))
    return [
        (base + geometry.offset(layer, first), count * geometry.block_bytes)
        for layer in range(creds.num_layers)
        for first, count in runs
    ]


class Responder:
    """One sender connection's responder QP and its CQ; `lock` serializes post+poll on that CQ."""

    def __init__(self, res: RdmaResources, hello: bytes) -> None:
        self.res = res
        self.qp, self.cq = res.create_qp()
        res.connect(self.qp, QpInfo(**json.loads(hello)), responder=True)
        self.reply = json.dumps(asdict(res.local_info(self.qp))).encode()
        self.lock = threading.Lock()
        self._wr_ids = 0
        self.closed = False

    def run(self, wrs: list, timeout: float | None = None) -> None:
        """Post `wrs` (`RdmaResources.run_chain`: pieces that fit the send queue, each piece's last
        WR signaled) and wait for their completion; OSError if any failed."""
        with self.lock:
            if self.closed:
                raise OSError("responder QP closed")
            for wr in wrs:
                self._wr_ids += 1
                wr.wr_id = self._wr_ids
            self.res.run_chain(self.qp, self.cq, wrs, timeout)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            if hasattr(self.qp, "close"):
                self.qp.close()


class Grant:
    """One session's remote access through one responder: windows (or MRs) and their revocation."""

    def __init__(self, responder: Responder, ranges: list[tuple[int, int]], use_mw: bool) -> None:
        self.responder = responder
        self.use_mw = use_mw
        self.ranges = ranges
        self.keys: list = []
        """The MWs (or MRs) to free at revocation."""
        self.rkeys: list[int] = []
        """The remote key of each range: an MR's own, or the key its window's BIND_MW gave it."""
        res, v = responder.res, responder.res.v
        if not use_mw:  # fallback: a per-session MR per range, valid on every QP of the PD
            access = v.enums.IBV_ACCESS_LOCAL_WRITE | v.enums.IBV_ACCESS_REMOTE_WRITE
            self.keys = [v.MR(res.pd, length, access, address=addr) for addr, length in ranges]
            self.rkeys = [mr.rkey for mr in self.keys]
            return
        wrs = []
        for addr, length in ranges:
            mw = v.MW(res.pd, v.enums.IBV_MW_TYPE_2)
            self.keys.append(mw)
            wr = v.SendWR(opcode=v.enums.IBV_WR_BIND_MW, send_flags=0)
            wr.set_bind_wr(mw, v.MWBindInfo(res.mr, addr, length, v.enums.IBV_ACCESS_REMOTE_WRITE))
            wrs.append(wr)
        try:
            responder.run(wrs, BIND_TIMEOUT)
        except OSError:
            self.revoke()
            raise
        # type 2: the bound key is the one the bind WR carried (pyverbs computes it in set_bind_wr);
        # the MW object's rkey is its allocation key, which grants nothing
        self.rkeys = [wr.rkey for wr in wrs]

    def windows(self) -> list[list[int]]:
        """[address, length, rkey] of every range, for the sender."""
        return [[addr, length, rkey] for (addr, length), rkey in zip(self.ranges, self.rkeys)]

    def revoke(self) -> None:
        """Invalidate every key (LOCAL_INV through the QP it was bound on), then free it. Returns only
        when no key of this grant can reach the pool (the emulated device, like a NIC, finishes an
        access in progress before the invalidation completes)."""
        v = self.responder.res.v
        if self.use_mw and self.keys:
            try:
                wrs = []
                for rkey in self.rkeys:
                    wr = v.SendWR(opcode=v.enums.IBV_WR_LOCAL_INV, send_flags=0)
                    wr.imm_data = rkey  # pyverbs' LOCAL_INV key: invalidate_rkey shares imm_data's union
                    wrs.append(wr)
                self.responder.run(wrs, REVOKE_TIMEOUT)
            except Exception as e:  # QP in ERROR (flushed) or gone:
                log.info("LOCAL_INV of a session's windows did not complete (%s): deallocating them", e)
        for key in self.keys:  # deallocation revokes too, so it runs whatever happened above
            try:
                key.close()  # ibv_dealloc_mw / ibv_dereg_mr
            except Exception:
                log.exception("cannot free an RDMA key of a revoked session")
        self.keys, self.rkeys = [], []


def use_memory_windows(res: RdmaResources) -> bool:
    """Type-2 windows unless forced off ($PDSERVE_RDMA_ACCESS=mr) or the device cannot allocate one."""
    if os.environ.get(ACCESS_ENV, "mw") == "mr":
        return False
    try:
        res.v.MW(res.pd, res.v.enums.IBV_MW_TYPE_2).close()
        return True
    except Exception as e:  # PyverbsRDMAError / VerbsError: no MW support on this device
        log.warning("RDMA device has no type-2 memory windows (%s): per-session MRs instead", e)
        return False


class RdmaReceiver:
    """The receiver's RDMA state: the pool registration, one responder per sender connection, and the
    grants (see the module docstring). `server` is the CacheStoreServer whose sessions it guards."""

    def __init__(self, server, device: str, port: int = 1, gid_index: int = 0) -> None:
        self.server = server
        # the pool itself, or (CUDA pool without GPUDirect) a registered host mirror of it whose
        # landed blocks `landed` copies into the pool before a NOTIFY is acknowledged
        self.res = RdmaResources(device, server.region, port=port, gid_index=gid_index, mw_bind=True)
        self.staged = self.res.registration.mode == rdma_memory.STAGING
        rdma_memory.report(self.res.registration, server.metrics, "receiver")
        self.use_mw = use_memory_windows(self.res)
        self._responders: dict[int, Responder] = {}
        self._lock = threading.Lock()

    def control(self, conn, hello: bytes) -> tuple[int, bytes]:
        """One CONNECT message from an authenticated connection: (wire status, JSON reply)."""
        from pdserve.cachestore import wire

        try:
            msg = json.loads(hello)
            if "grant" in msg:
                g = msg["grant"]
                return self._grant(str(g["session_id"]), str(g["token"]), int(g["qp_num"]))
            responder = Responder(self.res, hello)
        except (ValueError, KeyError, TypeError) as e:
            raise wire.CorruptFrame(f"bad RDMA control message: {e}") from e
        if conn.attached is not None:  # one responder per connection: a second QP exchange replaces it
            conn.attached.close()
        conn.attached = responder
        with self._lock:
            self._responders = {n: r for n, r in self._responders.items() if not r.closed}
            self._responders[responder.qp.qp_num] = responder
        return wire.OK, responder.reply

    @property
    def remote_base(self) -> int:
        """The address senders WRITE the pool at (the pool's own, or its host mirror's)."""
        return self.res.address

    def landed(self, layer: int, block_ids, heads: tuple[int, int] | None = None) -> None:
        """A NOTIFY passed its checks: before it is acknowledged, make its WRITEs visible in the pool.
        With a staged (CUDA) pool, copy the blocks (or those heads' K/V slices of them) from the host
        mirror into the pool; with GPUDirect, flush the NIC's writes where the device needs it
        (`cachestore.gpudirect`); nothing to do for a host pool."""
        flush = self.res.registration.flush
        if flush is not None:
            flush()
        if not self.staged:
            return
        geometry = self.server.geometry
        if heads is not None:
            spans = geometry.head_spans(layer, block_ids, *heads)
        else:
            spans = [(geometry.offset(layer, b), n * geometry.block_bytes) for b, n in block_runs(block_ids)]
        rdma_memory.commit(self.res.registration, self.server.region.tensor, spans)

    def close(self) -> None:
        """Server stop: responders close with their connections; the pool registration goes here."""
        self.res.close()

    def _grant(self, session_id: str, token: str, qp_num: int) -> tuple[int, bytes]:
        from pdserve.cachestore import wire

        with self._lock:
            responder = self._responders.get(qp_num)
        if responder is None or responder.closed:
            return wire.UNKNOWN_SESSION, b""
        session, status = self.server.check_grant(session_id, token)
        if session is None:
            self.server.reject(status)
            return status, b""
        grant = Grant(responder, session_ranges(self.server.geometry, session.creds, self.res.address), self.use_mw)
        if not self.server.add_grant(session, grant.revoke):  # closed while binding, or too many grants
            grant.revoke()
            return wire.SESSION_CLOSED, b""
        return wire.OK, json.dumps({"windows": grant.windows()}).encode()
