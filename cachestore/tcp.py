"""TCP transport: one thread per connection, payloads received straight into the pool.

Blocking sockets in dedicated threads (recv_into releases the GIL) keep the
KV data path off the node's asyncio loop and reach plain-socket throughput.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading

from cachestore import wire

log = logging.getLogger("pdserve.cachestore")
HANDSHAKE_TIMEOUT = 5.0
DISCARD_CHUNK = 1 << 20


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
    buf = bytearray(n)
    return bytes(buf) if recv_exact_into(sock, memoryview(buf)) else None


class TcpListener:
    """Accepts sender connections for one CacheStoreServer."""

    def __init__(self, server, host: str, port: int) -> None:
        self.server = server
        self.sock = socket.create_server((host, port), reuse_port=False)
        self._stopping = False
        self._conns: set[socket.socket] = set()
        self._staging: dict[socket.socket, object] = {}
        """Per-connection host buffer for a device pool (only its own thread touches its entry)."""
        self._lock = threading.Lock()

    def start(self) -> str:
        host, port = self.sock.getsockname()[:2]
        threading.Thread(target=self._accept_loop, name="cachestore-accept", daemon=True).start()
        return f"{host}:{port}"

    def stop(self) -> None:
        self._stopping = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="cachestore-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._handshake(conn):
                self._frames(conn)
        except (OSError, wire.CorruptFrame) as e:
            log.warning("cachestore connection dropped: %s", e)
            self.server.reject("corrupt")
        finally:
            with self._lock:
                self._conns.discard(conn)
            self._staging.pop(conn, None)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        nonce = os.urandom(wire.NONCE_BYTES)
        conn.settimeout(HANDSHAKE_TIMEOUT)
        conn.sendall(nonce)
        tag = recv_exact(conn, wire.MAC_BYTES)
        conn.settimeout(None)
        if tag is None or not hmac.compare_digest(tag, wire.auth_tag(self.server.secret, nonce)):
            self.server.reject("bad_secret")
            return False
        return True

    def _frames(self, conn: socket.socket) -> None:
        header = bytearray(wire.HEADER_BYTES)
        hview = memoryview(header)
        server = self.server
        while True:
            if not recv_exact_into(conn, hview):
                return
            h = wire.unpack(hview)
            if h.kind == wire.KIND_CONNECT:
                self._rdma_connect(conn, h)
                continue
            if h.kind == wire.KIND_ACK:
                raise wire.CorruptFrame("ACK frame sent to the receiver")
            expects_payload = h.kind == wire.KIND_WRITE
            if not expects_payload and (server.active_transport != "rdma" or h.payload_len):
                raise wire.CorruptFrame("NOTIFY frame outside the rdma transport")
            session, status = server.begin_write(h._replace(payload_len=h.payload_len if expects_payload
                                                          else h.count * server.geometry.block_bytes))
            if session is None:
                server.reject(status)
                # well-formed but refused: skip its payload, keep the stream in sync, tell the sender
                if expects_payload and not _discard(conn, h.payload_len):
                    return
                conn.sendall(_ack(h, status))
                continue
            ok = False
            try:
                ok = not expects_payload or self._receive_payload(conn, h)
            finally:
                server.end_write(session, h, ok)
            if not ok:
                return  # peer vanished mid-payload: the session will expire or be closed
            conn.sendall(_ack(h, wire.OK))

    def _rdma_connect(self, conn: socket.socket, h: wire.Header) -> None:
        """QP info exchange for the rdma transport (not exercised here: no RDMA devices)."""
        if self.server.active_transport != "rdma" or h.payload_len > wire.MAX_CONNECT_BYTES:
            raise wire.CorruptFrame("CONNECT frame outside the rdma transport")
        hello = recv_exact(conn, h.payload_len)
        if hello is None:
            raise OSError("peer closed during the RDMA connect")
        reply = self.server.rdma_accept(hello)
        zero = b"\0" * 16
        conn.sendall(wire.Header(wire.KIND_CONNECT, wire.OK, zero, zero, 0, 0, 0, 0, len(reply)).pack() + reply)

    def _receive_payload(self, conn: socket.socket, h: wire.Header) -> bool:
        region = self.server.region
        if not region.is_device:
            return recv_exact_into(conn, self.server.destination(h))
        # device pool: land in this connection's reused host buffer, then one host-to-device copy
        staging = self._staging.get(conn)
        if staging is None:
            from cachestore.staging import HostStaging
            staging = self._staging[conn] = HostStaging(self.server.geometry.block_bytes)
        if not recv_exact_into(conn, staging.landing(h.payload_len)):
            return False
        staging.commit(region.tensor, self.server.geometry.offset(h.layer, h.dst_block), h.payload_len)
        return True


def _discard(conn: socket.socket, n: int) -> bool:
    scratch = memoryview(bytearray(min(n, DISCARD_CHUNK) or 1))
    while n > 0:
        chunk = min(n, len(scratch))
        if not recv_exact_into(conn, scratch[:chunk]):
            return False
        n -= chunk
    return True


def _ack(h: wire.Header, status: int) -> bytes:
    return wire.Header(wire.KIND_ACK, status, h.session_id, b"\0" * 16, h.layer, h.dst_block, h.count,
                       h.seq, 0).pack()
