"""TcpListener: accepts CacheStore senders on one poller thread; frames go to a bounded worker pool.

Why this shape: a thread per connection let 400 idle or dripping sockets make 400 threads. Here one
poller thread (a `selectors` loop) owns every socket while it is idle, in its handshake, or between
frames; it reads the handshake and frame headers without blocking and enforces their deadlines.
Only a connection with a complete frame header in hand is passed to a worker, which receives the
payload straight into the pool with a blocking `recv_into` (fast, releases the GIL) and keeps the
connection while further frames follow at once, so a streaming sender costs no wake-up per frame.
Threads: 1 poller + at most `max_workers`, whatever the number of sockets.

With a `LinkTLS` every accepted socket is wrapped, and the poller drives its TLS handshake without
blocking (under the same handshake deadline) before it sends the nonce of the HMAC handshake. TLS
decrypts whole records, so bytes can wait inside the TLS layer where poll cannot see them: the
poller drains those itself, after a read and when a worker hands a connection back.
"""

from __future__ import annotations

import hmac
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from pdserve.cachestore import wire
from pdserve.cachestore.tcp import Connection, TcpLimits, hold_blocking, set_kernel_timeouts
from pdserve.cachestore.tcp_receiver import FrameWorker
from pdserve.cachestore.tls import LinkTLS

log = logging.getLogger("pdserve.cachestore")
SWEEP_SECONDS = 0.2
"""How often the poller checks handshake and header deadlines."""
MAX_ACCEPT_BACKOFF = 1.0


class TcpListener:
    """Accepts sender connections for one CacheStoreServer (see the module docstring for the threads)."""

    def __init__(
        self, server, host: str, port: int, limits: TcpLimits | None = None, tls: LinkTLS | None = None
    ) -> None:
        self.server = server
        self.limits = limits or TcpLimits()
        self.tls = tls
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.sock.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._returned: list[Connection] = []
        self._lock = threading.Lock()
        self._conns: set[Connection] = set()
        self._workers = ThreadPoolExecutor(self.limits.max_workers, thread_name_prefix="cachestore-recv")
        self._frames = FrameWorker(server, self.limits.frame_timeout)
        self._stopping = False
        self._accept_backoff = 0.0
        self._accept_retry_at: float | None = None
        self._thread = threading.Thread(target=self._poll_loop, name="cachestore-poll", daemon=True)
        self.up = False

    def start(self) -> str:
        self.selector.register(self.sock, selectors.EVENT_READ, "listen")
        self.selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._set_up(True)
        self._thread.start()
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        self._thread.join(5)
        with self._lock:
            conns = list(self._conns)
        for c in conns:  # wakes workers blocked in recv_into
            c.shutdown()
        self._workers.shutdown(wait=False, cancel_futures=True)

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # --- poller thread ------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self.selector.select(SWEEP_SECONDS):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        self._take_back()
                    else:
                        self._on_readable(key.data)
                self._sweep(time.monotonic())
        finally:
            with self._lock:
                conns = list(self._conns)
            for c in conns:
                if c.busy:
                    c.shutdown()  # its worker closes it
                else:
                    self._close(c)
            self.selector.close()
            self.sock.close()
            self._wake_r.close()
            self._wake_w.close()
            self._set_up(False)

    def _accept(self) -> None:
        try:
            sock, _ = self.sock.accept()
        except BlockingIOError:
            return
        except OSError as e:  # EMFILE, ENFILE, ENOBUFS...: back off and retry, never die
            self.server.metrics.accept_errors.inc()
            self._accept_backoff = min(max(self._accept_backoff * 2, 0.05), MAX_ACCEPT_BACKOFF)
            log.error("cachestore accept failed (%s): retrying in %.2fs", e, self._accept_backoff)
            self.selector.unregister(self.sock)
            self._accept_retry_at = time.monotonic() + self._accept_backoff
            self._set_up(False)
            return
        self._accept_backoff = 0.0
        self._set_up(True)
        with self._lock:
            total = len(self._conns)
            unauthenticated = sum(1 for c in self._conns if not c.authenticated)
        if total >= self.limits.max_connections or unauthenticated >= self.limits.max_unauthenticated:
            self.server.reject("too_many_connections")
            sock.close()
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        set_kernel_timeouts(sock, self.limits.frame_timeout)  # bounds a worker's blocking calls (see FrameWorker)
        sock.setblocking(False)
        if self.tls is not None:
            sock = self.tls.wrap_server(sock)
        c = Connection(
            sock, os.urandom(wire.NONCE_BYTES), time.monotonic() + self.limits.handshake_timeout, self.tls is not None
        )
        if not c.handshaking and not c.send_nonce():
            sock.close()
            return
        with self._lock:
            self._conns.add(c)
        self.server.metrics.connections.set(len(self._conns))
        self.selector.register(sock, selectors.EVENT_READ, c)

    def _handshake(self, c: Connection) -> None:
        """One step of a TLS handshake (the handshake deadline runs meanwhile); once done, the nonce
        goes out, inside TLS."""
        try:
            if not c.tls_step():
                return
        except OSError as e:  # no certificate, one from another CA, not TLS at all
            log.warning("cachestore TLS handshake refused: %s", e)
            self.server.reject("tls_handshake")
            self._close(c)
            return
        if not c.send_nonce():
            self._close(c)

    def _on_readable(self, c: Connection) -> None:
        if c.handshaking:
            self._handshake(c)
            return
        self._read_some(c)
        # bytes already decrypted in the TLS layer never wake the selector: read them now
        while isinstance(c.sock, ssl.SSLSocket) and not (c.busy or c.closed) and c.sock.pending():
            self._read_some(c)

    def _read_some(self, c: Connection) -> None:
        try:
            n = c.sock.recv_into(c.pending_view())
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            n = 0
        if n == 0:
            self._close(c)
            return
        c.filled += n
        if not c.authenticated:
            if c.filled == wire.MAC_BYTES:
                if not hmac.compare_digest(bytes(c.buf[: wire.MAC_BYTES]), wire.auth_tag(self.server.secret, c.nonce)):
                    self.server.reject("bad_secret")
                    self._close(c)
                    return
                c.authenticated, c.filled, c.deadline = True, 0, None
            return
        if c.deadline is None:  # a frame started: its header must complete in time
            c.deadline = time.monotonic() + self.limits.frame_timeout
        if c.filled == wire.HEADER_BYTES:
            self.selector.unregister(c.sock)
            c.busy = True
            hold_blocking(c.sock, self.limits.frame_timeout)
            self._workers.submit(self._serve, c)

    def _sweep(self, now: float) -> None:
        if self._accept_retry_at is not None and now >= self._accept_retry_at:
            self._accept_retry_at = None
            self.selector.register(self.sock, selectors.EVENT_READ, "listen")
        with self._lock:
            late = [c for c in self._conns if c.deadline is not None and now > c.deadline and not c.busy]
        for c in late:
            self.server.reject("handshake_timeout" if not c.authenticated else "frame_timeout")
            self._close(c)

    def _take_back(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            returned, self._returned = self._returned, []
        for c in returned:
            c.busy = False
            if c.closed:
                continue
            c.sock.setblocking(False)
            self.selector.register(c.sock, selectors.EVENT_READ, c)
            if isinstance(c.sock, ssl.SSLSocket) and c.sock.pending():  # already read by TLS: poll will not say
                self._on_readable(c)

    def _close(self, c: Connection) -> None:
        if not c.busy:
            try:
                self.selector.unregister(c.sock)
            except (KeyError, ValueError):
                pass
        c.close()
        with self._lock:
            self._conns.discard(c)
            self.server.metrics.connections.set(len(self._conns))

    # --- worker threads --------------------------------------------------------------------------
    def _serve(self, c: Connection) -> None:
        """Handle frames while they keep coming, then give the connection back to the poller."""
        keep = False
        try:
            keep = self._frames.serve(c)
        except Exception as e:  # noqa: BLE001 - a broken stream drops one connection, never the worker
            log.warning("cachestore connection dropped: %s", e)
            self.server.reject("corrupt")
        if not keep:
            c.close()
            with self._lock:
                self._conns.discard(c)
                self.server.metrics.connections.set(len(self._conns))
        with self._lock:
            self._returned.append(c)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _set_up(self, up: bool) -> None:
        if up != self.up:
            self.up = up
            self.server.metrics.listener_up.set(1 if up else 0)
            self.server.listener_changed(up)
