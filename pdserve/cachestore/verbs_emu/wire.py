"""The emulated device's wire: RC packets between processes over loopback sockets (EMULATED).

Soft-RoCE (rxe) carries InfiniBand transport packets in UDP datagrams and implements RC's
reliability itself (PSNs, ACK/NAK, retransmission on timeout). Here each requester QP opens one
TCP connection to the responder's device endpoint instead, so reliable in-order delivery comes from
the kernel and the emulation keeps only what the verbs specification defines at the transport
level: packets with a sequence number, a first packet whose RETH (virtual address, rkey, DMA length)
the responder checks BEFORE any byte of the message lands, an ACK or a NAK per message, and the
error classes (IBTA vol. 1 ch. 9.9; the responder state machine of rxe_resp.c follows the same
rules):

  * the responder QP must be in RTR or RTS and connected to exactly this requester (GID + QPN);
    otherwise the packets are silently dropped, and the requester's retries run out
    (IBV_WC_RETRY_EXC_ERR: here the connection is closed, no timers are emulated);
  * a responder QP without REMOTE_WRITE access answers NAK "invalid request" (class C:
    IBV_WC_REM_INV_REQ_ERR at the requester, the responder QP moves to ERROR);
  * an rkey naming no MR/MW of this device, a range outside it, missing access rights, or a
    type-2 window bound through another QP: NAK "remote access error" (class C:
    IBV_WC_REM_ACCESS_ERR at the requester, the responder QP moves to ERROR);
  * WRITE_WITH_IMM with no receive WR posted: RNR NAK (class B; no RNR retries are emulated, so the
    requester completes with IBV_WC_RNR_RETRY_EXC_ERR; the responder QP stays usable). The emulation
    checks the receive WR at the first packet, so a refused message lands nothing.

Each packet's payload is received into a bounce buffer, then copied into the target memory under
the MR/MW lock after the key is looked up again, so an invalidation (LOCAL_INV, dealloc, dereg)
that completed before the copy keeps every byte out, and one that runs during it waits for it
(what a NIC guarantees: invalidation completes after the accesses in progress).

The device endpoint (one listening socket per process, 127.0.0.1) is encoded in the GID that
`Context.query_gid` returns, so the existing QP exchange (QPN + GID) carries it unchanged.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import struct
import threading
from typing import Any

from pdserve.cachestore.sockio import recv_exact, recv_exact_into, sendmsg_all
from pdserve.cachestore.verbs_emu import enums
from pdserve.cachestore.verbs_emu.completion import WC
from pdserve.cachestore.verbs_emu.memory import remote_target

log = logging.getLogger("pdserve.cachestore.verbs_emu")

HOST_ENV = "PDSERVE_RDMA_EMULATOR_HOST"
MTU = 256 << 10
"""Payload bytes per emulated packet (a NIC's MTU is 1-4 KiB; bigger here, per packet Python costs)."""
ACK_TIMEOUT = 30.0
"""Seconds a requester waits for the ACK of a message before its retries count as exhausted (long:
a loaded CI machine is slow, not lossy)."""

MAGIC = b"EMUV"
HELLO = struct.Struct("!4sH16sII I")
"""magic, version, requester GID (16 bytes), requester QPN, responder QPN, requester start PSN."""
VERSION = 1
REQUEST = struct.Struct("!BxxxIQIIII")
"""opcode, PSN, RETH (virtual address, rkey, DMA length), payload bytes of this packet, immediate."""
RESPONSE = struct.Struct("!BBxxI")
"""AETH: kind (ACK / NAK), syndrome, PSN."""

# packet opcodes (the RC RDMA WRITE family; WITH_IMM is a flag on the last/only packet)
OP_FIRST, OP_MIDDLE, OP_LAST, OP_ONLY = 0, 1, 2, 3
OP_WITH_IMM = 0x10
ACK, NAK = 0, 1
# NAK syndromes (AETH)
SYN_NONE, SYN_PSN_SEQ, SYN_RNR, SYN_INVALID_REQ, SYN_REMOTE_ACCESS = 0, 1, 2, 3, 4
SYNDROME_STATUS = {
    SYN_PSN_SEQ: enums.IBV_WC_RETRY_EXC_ERR,
    SYN_RNR: enums.IBV_WC_RNR_RETRY_EXC_ERR,
    SYN_INVALID_REQ: enums.IBV_WC_REM_INV_REQ_ERR,
    SYN_REMOTE_ACCESS: enums.IBV_WC_REM_ACCESS_ERR,
}
"""The requester's completion status for each NAK."""


# GIDs ------------------------------------------------------------------------------------------------
def make_gid(host: str, port: int) -> str:
    """An emulated GID: the link-local prefix fe80::/64, then the endpoint's IPv4 address, TCP port
    and a 1 (so an emulated GID never looks like a real interface id)."""
    a = int(ipaddress.IPv4Address(host))
    words = [0xFE80, 0, 0, 0, a >> 16, a & 0xFFFF, port, 1]
    return ":".join(f"{w:04x}" for w in words)


def parse_gid(gid) -> tuple[str, int] | None:
    """(host, port) of an emulated GID, None for any other GID (then the in-process path applies)."""
    try:
        packed = ipaddress.IPv6Address(gid.decode() if isinstance(gid, bytes) else str(gid)).packed
    except ValueError:
        return None
    words = struct.unpack("!8H", packed)
    if words[0] != 0xFE80 or words[7] != 1 or not words[6]:
        return None
    return str(ipaddress.IPv4Address((words[4] << 16) | words[5])), words[6]


def gid_bytes(gid: str) -> bytes:
    return ipaddress.IPv6Address(gid).packed


def local_view(address: int, length: int) -> memoryview:
    """Registered memory at `address` as bytes (what the NIC's DMA engine reads)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B")


# the device endpoint (responder side) --------------------------------------------------------------
class DeviceEndpoint:
    """One listening socket per emulated device (per process): a thread per requester connection
    plays the responder half of the device for the QP that connection names."""

    def __init__(self, fabric) -> None:
        self.fabric = fabric
        host = os.environ.get(HOST_ENV, "127.0.0.1")
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.gid = make_gid(host, self.port)
        self.connections = 0
        """Requester connections accepted so far (tests read it)."""
        threading.Thread(target=self._accept, name="emu-rdma-listen", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve, args=(conn,), name=f"emu-rdma-resp-{self.connections}", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            Responder(self.fabric, conn).run()
        except OSError:
            pass  # the requester went away: nothing to answer
        except Exception:
            log.exception("emulated RDMA responder failed")
        finally:
            conn.close()


class Responder:
    """The responder half of the device for one requester connection (see the module docstring)."""

    def __init__(self, fabric, conn: socket.socket) -> None:
        self.fabric, self.conn = fabric, conn
        self._bounce_buf = bytearray(MTU)
        self.bounce = memoryview(self._bounce_buf)
        self._bounce_addr = ctypes.addressof(ctypes.c_char.from_buffer(self._bounce_buf))
        self.qp: Any = None
        """The responder QP (`queues.QP`, which imports this module), once the hello named it."""
        self.psn = 0
        self.dropping = False
        """True once the responder QP went to ERROR: every later packet is dropped unanswered."""

    def _hello(self) -> bool:
        raw = recv_exact(self.conn, HELLO.size)
        if raw is None:
            return False
        magic, version, src_gid, src_qpn, dst_qpn, psn = HELLO.unpack(raw)
        if magic != MAGIC or version != VERSION:
            return False
        qp = self.fabric.qp(dst_qpn)
        # RC: a packet from any other source than the connected peer is silently dropped
        src = parse_gid(str(ipaddress.IPv6Address(src_gid)))
        if qp is None or qp.remote != src or qp.dest_qp_num != src_qpn:
            return False
        self.qp, self.psn = qp, psn
        return True

    def run(self) -> None:
        if not self._hello():
            return
        while True:
            raw = recv_exact(self.conn, REQUEST.size)
            if raw is None:
                return
            if not self._message(REQUEST.unpack(raw)):
                return

    def _usable(self) -> bool:
        qp = self.qp
        assert qp is not None, "packets follow the hello"
        return (
            not qp._closed and self.fabric.qp(qp.qp_num) is qp and qp.qp_state in (enums.IBV_QPS_RTR, enums.IBV_QPS_RTS)
        )

    def _message(self, first: tuple) -> bool:
        """One RDMA WRITE message starting with packet `first`; False to drop the connection."""
        opcode, psn, va, rkey, dma_len, nbytes, imm = first
        if self.dropping or not self._usable():
            return False  # a QP in ERROR (or gone) drops packets: the requester's retries run out
        qp, syndrome, target = self.qp, SYN_NONE, None
        assert qp is not None, "packets follow the hello"
        if (opcode & 0x0F) not in (OP_FIRST, OP_ONLY) or psn != self.psn:
            syndrome = SYN_PSN_SEQ  # (over a TCP stream this means a broken requester)
        elif not qp.access & enums.IBV_ACCESS_REMOTE_WRITE:
            syndrome = SYN_INVALID_REQ
        elif opcode & OP_WITH_IMM and not qp._rq:
            syndrome = SYN_RNR
        elif dma_len > 1 << 31:
            syndrome = SYN_INVALID_REQ
        else:  # the RETH check, for the whole DMA range, before any byte lands
            target = self.fabric.key(rkey)
            if getattr(target, "lock", None) is None or not remote_target(
                target, qp, va, dma_len, enums.IBV_ACCESS_REMOTE_WRITE
            ):
                syndrome, target = SYN_REMOTE_ACCESS, None
        offset, header, last_psn = 0, first, psn
        while True:
            op, pkt_psn, _, _, _, nbytes, imm = header
            if nbytes > len(self.bounce) or pkt_psn != last_psn:
                return False  # malformed stream
            view = self.bounce[:nbytes]
            if not recv_exact_into(self.conn, view):
                return False
            if syndrome == SYN_NONE:
                if offset + nbytes > dma_len:
                    syndrome = SYN_INVALID_REQ
                else:
                    syndrome = self._land(target, rkey, va + offset, view)
            offset += nbytes
            if (op & 0x0F) in (OP_LAST, OP_ONLY):
                break
            raw = recv_exact(self.conn, REQUEST.size)
            if raw is None:
                return False
            header = REQUEST.unpack(raw)
            last_psn = (last_psn + 1) & 0xFFFFFF
        self.psn = (last_psn + 1) & 0xFFFFFF
        if syndrome == SYN_NONE and offset != dma_len:
            syndrome = SYN_INVALID_REQ
        if syndrome == SYN_NONE and header[0] & OP_WITH_IMM:
            recv = qp._rq.popleft() if qp._rq else None
            if recv is None:
                syndrome = SYN_RNR
            else:
                qp.rcq.push(
                    WC(recv.wr_id, enums.IBV_WC_SUCCESS, enums.IBV_WC_RECV_RDMA_WITH_IMM, qp.qp_num, dma_len, header[6])
                )
        self.conn.sendall(RESPONSE.pack(ACK if syndrome == SYN_NONE else NAK, syndrome, last_psn))
        if syndrome in (SYN_INVALID_REQ, SYN_REMOTE_ACCESS):
            self.dropping = True  # class C: the responder QP goes to ERROR after the NAK
            qp.to_error()
        return True

    def _land(self, target, rkey: int, address: int, view: memoryview) -> int:
        """Copy one packet's payload into the target memory, the key looked up again under its lock."""
        with target.lock:
            if self.fabric.key(rkey) is not target or not remote_target(
                target, self.qp, address, len(view), enums.IBV_ACCESS_REMOTE_WRITE
            ):
                return SYN_REMOTE_ACCESS  # invalidated mid-message: the rest lands nowhere
            ctypes.memmove(address, self._bounce_addr, len(view))  # view is bounce[:n]
        return SYN_NONE


# the requester side -----------------------------------------------------------------------------------
class RequesterLink:
    """A requester QP's connection to its responder's device (opened at the first WRITE)."""

    def __init__(self, qp, remote: tuple[str, int], start_psn: int) -> None:
        self.qp, self.remote, self.psn = qp, remote, start_psn
        self.sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self.sock is None:
            sock = socket.create_connection(self.remote, timeout=ACK_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ours = gid_bytes(self.qp.pd.ctx.fabric.endpoint().gid)
            sock.sendall(HELLO.pack(MAGIC, VERSION, ours, self.qp.qp_num, self.qp.dest_qp_num, self.psn))
            self.sock = sock
        return self.sock

    def write(self, sges: list[tuple[int, int, int]], rkey: int, va: int, imm: int | None) -> int:
        """Send one RDMA WRITE message (the bytes of the (addr, length, lkey) SGEs, in MTU packets)
        and wait for its ACK/NAK; returns the completion status."""
        try:
            sock = self._connect()
            length = sum(n for _, n, _ in sges)
            chunks = [(addr + at, min(MTU, n - at)) for addr, n, _ in sges for at in range(0, n, MTU)]
            if not chunks:
                chunks = [(0, 0)]
            first_psn = self.psn
            for i, (addr, n) in enumerate(chunks):
                op = (
                    (OP_ONLY if len(chunks) == 1 else OP_FIRST)
                    if i == 0
                    else (OP_LAST if i == len(chunks) - 1 else OP_MIDDLE)
                )
                if imm is not None and op in (OP_LAST, OP_ONLY):
                    op |= OP_WITH_IMM
                header = REQUEST.pack(op, self.psn, va, rkey, length, n, imm or 0)
                sendmsg_all(sock, [header, local_view(addr, n)] if n else [header])
                self.psn = (self.psn + 1) & 0xFFFFFF
            raw = recv_exact(sock, RESPONSE.size)
        except OSError:  # refused, reset, or no answer in time: the retries ran out
            self.close()
            return enums.IBV_WC_RETRY_EXC_ERR
        if raw is None:
            self.close()
            return enums.IBV_WC_RETRY_EXC_ERR
        kind, syndrome, psn = RESPONSE.unpack(raw)
        if kind == ACK and psn == (first_psn + len(chunks) - 1) & 0xFFFFFF:
            return enums.IBV_WC_SUCCESS
        self.close()
        return SYNDROME_STATUS.get(syndrome, enums.IBV_WC_RETRY_EXC_ERR)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None
