"""TcpChannel: one pooled sender connection (a send thread and an ack-reader thread)."""

from __future__ import annotations

import queue
import socket
import threading

from cachestore import wire
from cachestore.geometry import Run
from cachestore.staging import HostStaging
from cachestore.tcp import recv_exact, recv_exact_into

CONNECT_TIMEOUT = 5.0


class TcpChannel:
    """Frames from many transfers share the connection; acks come back by sequence number."""

    def __init__(self, client, endpoint: str, hello: bytes | None = None) -> None:
        self.client = client
        self.endpoint = endpoint
        self.broken = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, object] = {}
        self._lock = threading.Lock()
        self._seq = 0
        # a device pool is read through one host buffer, allocated once for the connection
        self._staging = HostStaging(client.geometry.block_bytes) if client.region.is_device else None
        host, port = endpoint.rsplit(":", 1)
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = recv_exact(self.sock, wire.NONCE_BYTES)
            if nonce is None:
                raise OSError("receiver closed the connection during the handshake")
            self.sock.sendall(wire.auth_tag(client.secret, nonce))
            self.peer_hello = self._exchange(hello) if hello is not None else None
            self.sock.settimeout(None)
        except OSError as e:
            self.broken = True
            self._connect_error = f"cannot connect to CacheStore receiver {endpoint}: {e}"
            return
        threading.Thread(target=self._send_loop, name="cachestore-send", daemon=True).start()
        threading.Thread(target=self._ack_loop, name="cachestore-acks", daemon=True).start()

    def _exchange(self, hello: bytes) -> bytes:
        """RDMA control: send our QP info, read the receiver's (CONNECT frames)."""
        zero = b"\0" * 16
        self.sock.sendall(wire.Header(wire.KIND_CONNECT, 0, zero, zero, 0, 0, 0, 0, len(hello)).pack() + hello)
        h = wire.unpack(recv_exact(self.sock, wire.HEADER_BYTES) or b"")
        if h.kind != wire.KIND_CONNECT or h.status != wire.OK or h.payload_len > wire.MAX_CONNECT_BYTES:
            raise OSError("receiver refused the RDMA connection")
        return recv_exact(self.sock, h.payload_len) or b""

    def submit(self, transfer, layer: int, run: Run, ready_event, notify: bool = False) -> None:
        """Queue a WRITE of `run` (or, with notify, a NOTIFY that RDMA already wrote it)."""
        if self.broken:
            transfer._on_ack(False, getattr(self, "_connect_error", "connection lost"))
            return
        self._queue.put((transfer, layer, run, ready_event, notify))

    def _send_loop(self) -> None:
        client, block_bytes = self.client, self.client.geometry.block_bytes
        while True:
            item = self._queue.get()
            if item is None:
                return
            transfer, layer, run, ready_event, notify = item
            if transfer.failed:
                continue
            if client.faults is not None and not client.faults.before_write():
                transfer._on_ack(False, "injected fault")
                continue
            if ready_event is not None and self._staging is None:
                ready_event.synchronize()  # the layer's kernels are done before we read its blocks
            creds = transfer.creds
            with self._lock:
                self._seq += 1
                seq = self._seq
                self._pending[seq] = transfer
            kind = wire.KIND_NOTIFY if notify else wire.KIND_WRITE
            header = wire.Header(kind, 0, bytes.fromhex(creds.session_id), bytes.fromhex(creds.token),
                                 layer, run.dst_block, run.count, seq, 0 if notify else run.count * block_bytes)
            try:
                self.sock.sendall(header.pack())
                if not notify:
                    self.sock.sendall(self._payload(layer, run, header.payload_len, ready_event))
            except OSError as e:
                self._fail_all(f"connection to {self.endpoint} lost: {e}")
                return
            client.metrics.add_bytes("send", header.payload_len)

    def _payload(self, layer: int, run: Run, nbytes: int, ready_event) -> memoryview:
        """The run's bytes: a view of a host pool, or the staging copy of a device pool (after ready_event)."""
        client = self.client
        if self._staging is None:
            return client.source(layer, run)
        return self._staging.read(client.region.tensor, client.geometry.offset(layer, run.src_block), nbytes,
                                  ready_event)

    def _ack_loop(self) -> None:
        buf = bytearray(wire.HEADER_BYTES)
        view = memoryview(buf)
        while True:
            try:
                if not recv_exact_into(self.sock, view):
                    raise OSError("receiver closed the connection")
                h = wire.unpack(view)
            except (OSError, wire.CorruptFrame) as e:
                self._fail_all(f"connection to {self.endpoint} lost: {e}")
                return
            with self._lock:
                transfer = self._pending.pop(h.seq, None)
            if transfer is not None:
                ok = h.status == wire.OK
                transfer._on_ack(ok, "" if ok else f"receiver refused the write ({wire.REASONS.get(h.status)})")

    def _fail_all(self, reason: str) -> None:
        self.broken = True
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for transfer in pending:
            transfer._on_ack(False, reason)
        # queued but unsent writes fail too
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0]._on_ack(False, reason)
        self.close()

    def close(self) -> None:
        self.broken = True
        self._queue.put(None)
        sock = getattr(self, "sock", None)
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
