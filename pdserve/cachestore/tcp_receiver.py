"""FrameWorker: what a receive worker does with a connection whose frame header has arrived.

Validate the frame against its session, land the payload in the destination blocks before the
session's deadline (cut off at once if the session ends first), and acknowledge it. Blocking
`recv_into`/`recvmsg_into` in a worker thread releases the GIL and reaches plain-socket throughput.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Sequence

from pdserve.cachestore import wire
from pdserve.cachestore.geometry import block_runs
from pdserve.cachestore.sockio import IOV_MAX, advance_views, recv_exact, recv_exact_into
from pdserve.cachestore.tcp import Connection, Fence, bound_receive, hold_blocking, recv_nowait, wait_readable
from pdserve.cachestore.transport import Transport

log = logging.getLogger("pdserve.cachestore")
DISCARD_CHUNK = 1 << 20
LINGER_SECONDS = 0.005
"""How long a worker waits for the next frame before handing the connection back to the poller:
a streaming sender's frames follow within microseconds, an idle one costs the worker only this."""
ACK_WINDOW = 64
"""Most frames landed before a cumulative OK ack is sent even while more frames keep coming."""
NO_ACK = -1
"""_frame's answer for a frame that gets no ACK (an RDMA CONNECT, answered by its own reply)."""
DISCARD_BYTES_PER_SECOND = 64 << 20
"""Slowest rate at which a refused payload may be skipped (on top of the frame timeout)."""


_local = threading.local()


def _worker_staging():
    """This worker thread's host staging buffer for a device pool: allocated once, reused per frame."""
    staging = getattr(_local, "staging", None)
    if staging is None:
        from pdserve.cachestore.staging import HostStaging

        staging = _local.staging = HostStaging()
    return staging


class FrameWorker:
    """What a worker thread does with a connection whose frame header is complete."""

    def __init__(self, server, frame_timeout: float) -> None:
        self.server = server
        self.frame_timeout = frame_timeout

    def serve(self, c: Connection) -> bool:
        """Handle frames while they follow at once. True: hand the connection back (idle or a
        partial header); False: drop it.

        Acknowledgements are cumulative: an OK ack for seq N says every frame up to N landed. It is
        sent once no further frame is already waiting and the sender did not flag one as queued right
        behind (FLAG_MORE; held at most LINGER_SECONDS for it), or after ACK_WINDOW frames, so a burst
        of layers costs one ack, and a block is never acknowledged before its bytes landed. A refusal
        is acknowledged on its own, after the OKs before it.

        The socket stays blocking while the worker holds it, with the frame timeout set once in the
        kernel (`set_kernel_timeouts`): a Python-level timeout would cost an fcntl per change and a
        poll before every receive, several syscalls per frame for nothing."""
        sock = c.sock
        header = memoryview(c.buf)[: wire.HEADER_BYTES]
        ok_through: int | None = None
        unacked = 0
        wakes: list = []
        """Sessions whose owners wait on what a frame completed: woken once the ack is decided (sent or
        deferred), never ahead of it, and on any way out."""
        try:
            while True:
                c.filled, c.deadline = 0, None
                h = wire.unpack(header)
                status = self._frame(c, h, wakes)
                if status is None:
                    return False
                if status == wire.OK:
                    ok_through, unacked = h.seq, unacked + 1
                elif status != NO_ACK:
                    if ok_through is not None:
                        sock.sendall(_ack(h, wire.OK, ok_through))
                        ok_through, unacked = None, 0
                    sock.sendall(_ack(h, status, h.seq))
                got = recv_nowait(sock, header)  # is the next frame already here? then ack later, with it
                if got == 0:
                    return False
                c.filled = got or 0
                promised = h.status & wire.FLAG_MORE
                if ok_through is not None and ((c.filled == 0 and not promised) or unacked >= ACK_WINDOW):
                    sock.sendall(_ack(h, wire.OK, ok_through))
                    ok_through, unacked = None, 0
                _wake_all(wakes)
                more = self._linger(c, header)
                if more is not True:
                    if more is False and ok_through is not None:  # the promised frame did not come: ack now
                        sock.sendall(_ack(h, wire.OK, ok_through))
                    return more is False  # None: the peer closed
        finally:
            _wake_all(wakes)

    def _linger(self, c: Connection, header: memoryview) -> bool | None:
        """Wait up to LINGER_SECONDS for the rest of the next frame header. True: it is complete;
        False: hand the connection back (c.filled bytes of a partial header); None: the peer closed."""
        end = time.monotonic() + LINGER_SECONDS
        while c.filled < wire.HEADER_BYTES:
            left = end - time.monotonic()
            if left <= 0 or not wait_readable(c.sock, left):
                if c.filled:
                    c.deadline = time.monotonic() + self.frame_timeout
                return False
            n = recv_nowait(c.sock, header[c.filled :])
            if n is None:
                continue
            if n == 0:
                return None
            c.filled += n
        return True

    def _frame(self, c: Connection, h: wire.Header, wakes: list) -> int | None:
        """One frame; returns the status to acknowledge (NO_ACK for none), None if the stream cannot go on."""
        server, conn = self.server, c.sock
        if h.kind == wire.KIND_CONNECT:
            self._rdma_connect(c, h)
            return NO_ACK
        if h.kind == wire.KIND_ACK:
            raise wire.CorruptFrame("ACK frame sent to the receiver")
        heads = wire.unpack_heads(h.dst_block) if h.kind == wire.KIND_WRITEVH else None
        if h.kind == wire.KIND_NOTIFYH:  # head-sliced RDMA WRITEs: the head range rides in 4 payload bytes
            if server.active_transport != Transport.RDMA or h.payload_len != wire.HEADS.size:
                raise wire.CorruptFrame("NOTIFYH frame outside the rdma transport")
            raw = recv_exact(conn, wire.HEADS.size)
            if raw is None:
                raise OSError("peer closed inside a NOTIFYH frame")
            heads, h = wire.unpack_heads(wire.HEADS.unpack(raw)[0]), h._replace(payload_len=0)
        expects_payload = h.kind in (wire.KIND_WRITE, wire.KIND_WRITEV, wire.KIND_WRITEVH)
        if not expects_payload and (server.active_transport != Transport.RDMA or h.payload_len):
            raise wire.CorruptFrame("NOTIFY frame outside the rdma transport")
        if h.kind in (
            wire.KIND_WRITEV,
            wire.KIND_WRITEVH,
        ):  # the id list comes first: the whole list is validated before any byte lands
            status = server.check_header(h)
            if status != wire.OK:  # refused on its header alone: the list is skipped unread, like the payload
                server.reject(status)
                return status if self._discard(conn, h.count * wire.IDS.size + h.payload_len) else None
            raw = recv_exact(conn, h.count * wire.IDS.size)
            if raw is None:
                raise OSError("peer closed inside a block id list")
            block_ids: Sequence[int] = wire.unpack_ids(raw)
        else:
            block_ids = range(h.dst_block, h.dst_block + h.count)
        fence = Fence(conn)
        layout = server.geometry.heads
        per_block = layout.slice_bytes(*heads) if heads and layout else server.geometry.block_bytes
        session, status, writer = server.begin_write(
            h._replace(payload_len=h.payload_len if expects_payload else h.count * per_block),
            block_ids,
            fence.cut,
            heads,
        )
        if session is None:
            server.reject(status)
            # well-formed but refused: skip its payload, keep the stream in sync, tell the sender
            if expects_payload and not self._discard(conn, h.payload_len):
                return None
            return status
        ok = False
        try:
            if expects_payload:
                ok = self._receive_payload(conn, h, block_ids, session.deadline, fence, heads)
            else:  # an RDMA NOTIFY: the WRITEs completed; a staged CUDA pool copies them in first
                server.rdma_landed(h.layer, block_ids, heads)
                ok = True
        finally:
            accepted = server.end_write(session, writer, h.layer, block_ids, ok, wakes, heads)
        if not ok or fence.cut_off:
            return None  # peer vanished, missed its deadline, or was cut off: the stream cannot be trusted
        return wire.OK if accepted else wire.SESSION_CLOSED

    def _rdma_connect(self, c: Connection, h: wire.Header) -> None:
        """rdma transport control (JSON both ways): a QP info exchange, which gives the connection its
        responder QP, or a grant request for one session's windows (`cachestore.rdma_access`)."""
        if self.server.active_transport != Transport.RDMA or h.payload_len > wire.MAX_CONNECT_BYTES:
            raise wire.CorruptFrame("CONNECT frame outside the rdma transport")
        hello = recv_exact(c.sock, h.payload_len)
        if hello is None:
            raise OSError("peer closed during the RDMA connect")
        status, reply = self.server.rdma_control(c, hello)
        zero = b"\0" * 16
        c.sock.sendall(wire.Header(wire.KIND_CONNECT, status, zero, zero, 0, 0, 0, 0, len(reply)).pack() + reply)

    def _receive_payload(
        self,
        conn: socket.socket,
        h: wire.Header,
        block_ids: Sequence[int],
        deadline: float,
        fence: Fence,
        heads: tuple[int, int] | None = None,
    ) -> bool:
        """Land the payload in the (validated) destination blocks before the session's deadline;
        False if the peer closed, the deadline passed, or the session ended and cut this writer off.
        With `heads`, the payload is those heads of each block and lands in their strided K/V slices."""
        server = self.server
        left = deadline - time.monotonic()
        near_deadline = left < self.frame_timeout  # the kernel's receive timeout must stop at the deadline
        if near_deadline:
            bound_receive(conn, max(left, 0.001))
        try:
            geo = server.geometry
            if heads is not None:
                spans = geo.head_spans(h.layer, block_ids, *heads)
            else:
                spans = [(geo.offset(h.layer, b), n * geo.block_bytes) for b, n in block_runs(block_ids)]
            if not server.region.is_device:
                view = server.region.view
                return _recv_fenced(conn, [view[o : o + n] for o, n in spans], fence)
            # device pool: land in this worker thread's reused host buffer, then host-to-device copies
            staging = _worker_staging()
            if not _recv_fenced(conn, [staging.landing(h.payload_len)], fence):
                return False
            staging.scatter(server.region.tensor, spans)
            return True
        except (BlockingIOError, TimeoutError):  # the kernel receive timeout (SO_RCVTIMEO) expired
            if near_deadline:
                log.warning("cachestore write missed its session deadline: connection dropped")
                server.reject("deadline")
            else:
                log.warning("cachestore sender stalled %.0fs inside a payload: connection dropped", self.frame_timeout)
                server.reject("frame_timeout")
            return False
        finally:
            if near_deadline:
                bound_receive(conn, self.frame_timeout)

    def _discard(self, conn: socket.socket, n: int) -> bool:
        deadline = time.monotonic() + self.frame_timeout + n / DISCARD_BYTES_PER_SECOND
        scratch = memoryview(bytearray(min(n, DISCARD_CHUNK) or 1))
        while n > 0:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = min(n, len(scratch))
            if not recv_exact_into(conn, scratch[:chunk]):
                return False
            n -= chunk
        hold_blocking(conn, self.frame_timeout)  # blocking again, bounded as in serve
        return True


def _recv_fenced(conn: socket.socket, views: list[memoryview], fence: Fence) -> bool:
    """Fill `views` in order with vectored receives (`recvmsg_into`, no extra copy), checking the
    fence after every receive. A TLS socket has no `recvmsg_into`: one view per receive."""
    vectored = not isinstance(conn, ssl.SSLSocket)
    i = 0
    while i < len(views):
        if fence.cut_off:
            return False
        # no MSG_WAITALL: it would wake this thread for every segment that arrives (measured: 6x the
        # context switches per 64 KiB frame); returning with what is there lets the data pile up meanwhile
        n = (
            conn.recvmsg_into(views[i : i + IOV_MAX])[0]
            if vectored and len(views) - i > 1
            else conn.recv_into(views[i])
        )
        if n == 0:
            return False
        i = advance_views(views, i, n)  # past what landed
    return not fence.cut_off


def _wake_all(sessions: list) -> None:
    for session in sessions:
        session.signal()
    sessions.clear()


def _ack(h: wire.Header, status: int, seq: int) -> bytes:
    return wire.Header(wire.KIND_ACK, status, h.session_id, b"\0" * 16, h.layer, h.dst_block, h.count, seq, 0).pack()
