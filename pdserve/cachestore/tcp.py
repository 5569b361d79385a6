"""TCP transport basics shared by both sides: the listener's limits, socket timeouts and receives
(plain or TLS), the receiver's per-connection state,
and the fence that cuts a writer off.

`TcpListener` (tcp_listener.py) owns the receiving sockets and threads, `FrameWorker`
(tcp_receiver.py) handles frames, `TcpChannel` (tcp_sender.py) sends them.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import struct
from dataclasses import dataclass
from typing import Protocol

from pdserve.cachestore import wire
from pdserve.cachestore.sockio import shutdown_both

log = logging.getLogger("pdserve.cachestore")


@dataclass(frozen=True)
class TcpLimits:
    """Resource bounds of one TCP listener."""

    max_connections: int = 256
    """Open connections (authenticated or not); further ones are closed at accept."""
    max_unauthenticated: int = 32
    """Connections still in their handshake; further ones are closed at accept."""
    max_workers: int = 8
    """Threads that receive payloads (the poller thread comes on top)."""
    handshake_timeout: float = 5.0
    """Seconds from accept to a valid authentication tag."""
    frame_timeout: float = 10.0
    """Seconds from the first byte of a frame header to its last (and the bound on discarding a refused payload)."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_unauthenticated", "max_workers", "handshake_timeout", "frame_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TcpLimits.{name} must be positive, got {getattr(self, name)}")


def set_recv_timeout(sock: socket.socket, seconds: float) -> None:
    """The kernel's bound on one blocking receive (SO_RCVTIMEO): past it the receive fails with EAGAIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))


def set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound every blocking send and receive of `sock` in the kernel (SO_SNDTIMEO, SO_RCVTIMEO), so that
    a blocking socket needs no Python-level timeout (which costs a poll per call)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))
    set_recv_timeout(sock, seconds)


def hold_blocking(sock: socket.socket, seconds: float) -> None:
    """Blocking mode for a worker, each call bounded by `seconds`. A plain socket is bounded by its
    kernel timeouts (set at accept). A TLS socket needs a Python-level timeout: on a kernel timeout
    its read only hears "want more data" and blocks again, so the bound would never fire."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
    else:
        sock.setblocking(True)


def bound_receive(sock: socket.socket, seconds: float) -> None:
    """Bound the worker's receives of `sock` by `seconds` (see `hold_blocking`)."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
    else:
        set_recv_timeout(sock, seconds)


def recv_nowait(sock: socket.socket, view: memoryview) -> int | None:
    """What is already there, up to len(view) bytes, without waiting: None if nothing is, 0 if the
    peer closed. A TLS socket is read in non-blocking mode for the call (it takes no MSG_DONTWAIT),
    and only when something is buffered or readable, which spares most calls the mode switch."""
    if not isinstance(sock, ssl.SSLSocket):
        try:
            return sock.recv_into(view, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
    if not wait_readable(sock, 0):
        return None
    timeout = sock.gettimeout()
    sock.settimeout(0.0)
    try:
        return sock.recv_into(view)
    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):  # only part of a TLS record has arrived
        return None
    finally:
        sock.settimeout(timeout)


def wait_readable(sock: socket.socket, seconds: float) -> bool:
    """Whether `sock` has something to read (or was closed) within `seconds`: one poll(2), any fd
    number. Bytes a TLS socket already decrypted count, though poll cannot see them."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(seconds * 1000))


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class Attachment(Protocol):
    """Something that lives as long as one connection (the rdma transport's responder QP)."""

    def close(self) -> None: ...


class Connection:
    """One sender connection: its socket, handshake state and the frame header being read."""

    __slots__ = (
        "sock",
        "nonce",
        "deadline",
        "buf",
        "filled",
        "handshaking",
        "authenticated",
        "busy",
        "closed",
        "attached",
    )

    def __init__(self, sock: socket.socket, nonce: bytes, deadline: float, handshaking: bool = False) -> None:
        self.sock = sock
        self.nonce = nonce
        self.handshaking = handshaking
        """Its TLS handshake is not done yet (the nonce is sent after it)."""
        self.deadline: float | None = deadline
        """Handshake deadline, then the deadline of a started frame header; None while idle."""
        self.buf = bytearray(max(wire.HEADER_BYTES, wire.MAC_BYTES))
        self.filled = 0
        self.authenticated = False
        self.busy = False
        """A worker holds it (the poller neither reads it nor enforces its header deadline)."""
        self.closed = False
        self.attached: Attachment | None = None
        """What lives as long as the connection (the rdma transport's responder QP); closed with it."""

    def send_nonce(self) -> bool:
        """The receiver's nonce out: 16 bytes into an empty send buffer, never blocks. False: failed."""
        try:
            self.sock.send(self.nonce)
            return True
        except OSError:
            return False

    def tls_step(self) -> bool:
        """Advance the TLS handshake without blocking: True once it is done, False while the peer's
        next flight is due; OSError (ssl.SSLError) when the peer is refused."""
        try:
            self.sock.do_handshake()  # type: ignore[attr-defined]
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False
        self.handshaking = False
        return True

    def pending_view(self) -> memoryview:
        want = wire.HEADER_BYTES if self.authenticated else wire.MAC_BYTES
        return memoryview(self.buf)[self.filled : want]

    def shutdown(self) -> None:
        shutdown_both(self.sock)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.shutdown()
            self.sock.close()
            if self.attached is not None:
                self.attached.close()


class Fence:
    """Lets the session's owner stop one in-flight write from another thread.

    `cut` marks the write dead and shuts the socket down, which wakes a blocked
    `recv_into` at once; the receiving thread checks the mark after every receive,
    so at most the bytes already in the kernel buffer land, and they land while the
    writer is still counted, i.e. before the blocks can be given back.
    """

    __slots__ = ("conn", "cut_off")

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.cut_off = False

    def cut(self) -> None:
        self.cut_off = True
        shutdown_both(self.conn)
