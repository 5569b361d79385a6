"""A sender channel closes its socket only after its threads have let go of it.

OpenSSL keeps a TLS socket's descriptor number; closing the descriptor while the ack thread is still
inside a TLS call let that call's later reads and writes reach whatever connection the process opened
next under the same number (under load: other transfers' handshakes failing with "bad record mac").
"""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pdserve.cachestore.tcp_sender as tcp_sender


class ProbeSocket(socket.socket):
    """One end of a socketpair whose `recv_into`, once the stream has ended, stays inside a while longer
    (as a TLS read still working on the descriptor would), and which records whether it was closed while
    a thread was inside."""

    def __init__(self, fileno: int) -> None:
        super().__init__(fileno=fileno)
        self.inside = threading.Event()
        self.closed_while_inside = False
        self.closed = threading.Event()

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:  # type: ignore[override]
        self.inside.set()
        try:
            n = super().recv_into(buffer, nbytes, flags)
            if n == 0:
                time.sleep(0.3)
            return n
        finally:
            self.inside.clear()

    def close(self) -> None:
        self.closed_while_inside = self.closed_while_inside or self.inside.is_set()
        super().close()
        self.closed.set()


def test_close_waits_for_the_ack_thread_to_leave_the_socket(monkeypatch) -> None:
    ours, theirs = socket.socketpair()
    probe = ProbeSocket(ours.detach())
    monkeypatch.setattr(tcp_sender, "connect", lambda endpoint, secret, tls=None: probe)
    geometry = SimpleNamespace(block_bytes=64, heads=None)
    client = SimpleNamespace(geometry=geometry, region=SimpleNamespace(is_device=False), secret=b"s", tls=None)
    channel = tcp_sender.TcpChannel(client, "127.0.0.1:1")
    deadline = time.monotonic() + 10
    while channel.sock is None and time.monotonic() < deadline:  # the send thread connects
        time.sleep(0.01)
    assert channel.sock is probe
    time.sleep(0.1)  # the ack thread is blocked reading
    try:
        assert probe.inside.is_set(), "the ack thread is not reading"
        channel.close()  # shuts the socket down: the ack thread wakes and stays inside its read a while
        assert probe.closed.wait(10), "the socket was never closed"
        assert not probe.closed_while_inside, "the socket was closed under a thread still reading it"
        assert channel.broken
    finally:
        theirs.close()
