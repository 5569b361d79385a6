"""Blocking socket helpers shared by the tcp transport and the emulated verbs wire: exact receives and
vectored sends that resume after partial transfers, on plain or TLS sockets. Imports nothing from
the package."""

from __future__ import annotations

import socket
import ssl

IOV_MAX = 1024  # most buffers one sendmsg/recvmsg_into call may take (Linux's UIO_MAXIOV)


def advance_views(views: list[memoryview], i: int, n: int) -> int:
    """After a vectored send/receive moved `n` bytes starting at `views[i]`, drop what is done:
    returns the index of the first unfinished view (trimming a partly moved one in place)."""
    while n and i < len(views):
        if n >= len(views[i]):
            n -= len(views[i])
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def recv_exact_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False if the peer closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly `n` bytes from the socket; None if the peer closed first."""
    buf = bytearray(n)
    return bytes(buf) if recv_exact_into(sock, memoryview(buf)) else None


def sendmsg_all(sock: socket.socket, buffers: list) -> None:
    """Send every buffer (bytes or memoryviews) with vectored `sendmsg` calls: no join, no copy,
    resuming after partial sends. A TLS socket has no `sendmsg`: each buffer goes through `sendall`
    (TLS copies into its records anyway)."""
    if isinstance(sock, ssl.SSLSocket):
        for b in buffers:
            sock.sendall(b)
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    i = 0
    while i < len(views):
        n = sock.sendmsg(views[i : i + IOV_MAX])
        i = advance_views(views, i, n)


def shutdown_both(sock: socket.socket) -> None:
    """Shut both directions of the connection down, waking any thread blocked on it.

    On a TLS socket the descriptor is shut down beneath the TLS layer (`SSLSocket.shutdown` would
    also drop the TLS object under a thread still reading through it): that reader sees an end of
    stream, as on a plain socket."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass
