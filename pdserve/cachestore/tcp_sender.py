"""TcpChannel: one pooled sender connection (a send thread and an ack-reader thread)."""

from __future__ import annotations

import socket
import threading

from pdserve.cachestore import wire
from pdserve.cachestore.channel import Sender, Transfer
from pdserve.cachestore.geometry import Run
from pdserve.cachestore.sockio import recv_exact, recv_exact_into, sendmsg_all, shutdown_both
from pdserve.cachestore.staging import HostStaging
from pdserve.cachestore.tls import LinkTLS
from pdserve.cachestore.write_queue import WriteQueue

CONNECT_TIMEOUT = 5.0


def connect(endpoint: str, secret: bytes, tls: LinkTLS | None = None) -> socket.socket:
    """An authenticated connection to a receiver (the HMAC handshake done, inside mutual TLS when
    `tls` is given); OSError otherwise (ssl.SSLError, a subclass, when a certificate is refused)."""
    host, port = endpoint.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_client(sock)  # the handshake runs under CONNECT_TIMEOUT too
        nonce = recv_exact(sock, wire.NONCE_BYTES)
        if nonce is None:
            raise OSError("receiver closed the connection during the handshake")
        sock.sendall(wire.auth_tag(secret, nonce))
    except OSError:
        sock.close()
        raise
    return sock


def control_request(sock: socket.socket, message: bytes, limit: int = wire.MAX_CONNECT_BYTES) -> tuple[int, bytes]:
    """RDMA control: one CONNECT frame out (JSON), the receiver's (status, JSON reply of at most
    `limit` bytes) back."""
    zero = b"\0" * 16
    sock.sendall(wire.Header(wire.KIND_CONNECT, 0, zero, zero, 0, 0, 0, 0, len(message)).pack() + message)
    raw = recv_exact(sock, wire.HEADER_BYTES)
    if raw is None:
        raise OSError("receiver closed the connection during an RDMA control exchange")
    h = wire.unpack(raw)
    if h.kind != wire.KIND_CONNECT or h.payload_len > limit:
        raise OSError("receiver answered an RDMA control message with a foreign frame")
    reply = recv_exact(sock, h.payload_len) if h.payload_len else b""
    if reply is None:
        raise OSError("receiver closed the connection inside an RDMA control reply")
    return h.status, reply


class TcpChannel:
    """Frames from many transfers share the connection; acks come back by sequence number.

    It is made where a transfer opens, on the event loop, so it never connects there: its send
    thread connects (and authenticates) first, while the engine computes the first layer, and the
    writes queued meanwhile go out once it is up (or fail with the connect error). With a `hello`
    (the rdma transport's control connection, made on a lane's own thread) it connects at once,
    because the lane needs the peer's reply before anything else."""

    def __init__(self, client: Sender, endpoint: str, hello: bytes | None = None) -> None:
        self.client = client
        self.endpoint = endpoint
        self.broken = False
        self._queue = WriteQueue()
        self._pending: dict[int, tuple[Transfer, int]] = {}
        """seq -> (transfer, runs in the frame), in send order (acks are cumulative)."""
        self._lock = threading.Lock()
        self._seq = 0
        self._ids_cache: tuple[list[Run], int, bytes] | None = None
        """(runs, number of ids, packed ids) of the last frame: used by the send thread only."""
        # a device pool is read through one host buffer, allocated once for the connection
        self._staging = HostStaging(client.geometry.block_bytes) if client.region.is_device else None
        self.sock: socket.socket | None = None
        self.peer_hello: bytes | None = None
        self._connect_error = ""
        self._users = 1
        """Holders of the socket: the channel until `close`, and each thread that reads or writes it. The
        last one closes it (`_let_go`)."""
        self._closing = False
        if hello is None:
            self._start(self._connect_and_send, "cachestore-send")
        elif self._connect(hello):
            self._start(self._send_loop, "cachestore-send")
            self._start(self._ack_loop, "cachestore-acks")

    def _start(self, loop, name: str) -> None:
        """Run `loop` on a thread that holds the socket until it returns."""
        with self._lock:
            self._users += 1

        def run() -> None:
            try:
                loop()
            finally:
                self._let_go()

        threading.Thread(target=run, name=name, daemon=True).start()

    def _let_go(self) -> None:
        """One holder is done with the socket; the last closes it. A descriptor must not be closed under
        a thread still inside a TLS call: OpenSSL keeps the descriptor's number, which the next connect
        or accept in the process may be given, so that thread's remaining reads and writes would go to
        another connection (seen as handshakes failing with "bad record mac" under load)."""
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last and self.sock is not None:
            self.sock.close()

    def _connect(self, hello: bytes | None) -> bool:
        """Connect and authenticate (and, with a hello, exchange it); False and broken if that failed."""
        try:
            sock = connect(self.endpoint, self.client.secret, self.client.tls)
            self.sock = sock
            if hello is not None:
                status, self.peer_hello = control_request(sock, hello)
                if status != wire.OK:
                    raise OSError("receiver refused the RDMA connection")
            sock.settimeout(None)
            return True
        except OSError as e:
            self._connect_error = f"cannot connect to CacheStore receiver {self.endpoint}: {e}"
            self.broken = True
            return False

    def _connect_and_send(self) -> None:
        if not self._connect(None):
            self._fail_all(self._connect_error)
            return
        if self.broken:  # closed while connecting: nothing may go out any more
            self._fail_all("channel closed")
            return
        self._start(self._ack_loop, "cachestore-acks")
        self._send_loop()

    def submit(self, transfer, layer: int, run: Run, ready_event, notify: bool = False) -> None:
        """Queue a WRITE of `run` (or, with notify, a NOTIFY that RDMA already wrote it)."""
        self._put(transfer, layer, [run], ready_event, notify)

    def submit_layer(self, transfer, layer: int, runs: list[Run], ready_event) -> None:
        """Queue one WRITEV frame carrying every run of `layer`, whatever the block layout (one ack for all)."""
        self._put(transfer, layer, runs, ready_event, False)

    def prepare(self, transfer: Transfer) -> None:
        """Nothing per transfer: the connection is being made already (see the class docstring)."""

    def _put(self, transfer, layer: int, runs: list[Run], ready_event, notify: bool) -> None:
        if self.broken:
            transfer._on_ack(False, self._connect_error or "connection lost", len(runs))
            return
        self._queue.put((transfer, layer, runs, ready_event, notify))

    def _send_loop(self) -> None:
        client, block_bytes, sock = self.client, self.client.geometry.block_bytes, self.sock
        layout = client.geometry.heads
        assert sock is not None, "the send loop runs on a connected channel"
        for transfer, layer, runs, ready_event, notify in self._queue.live():
            if client.faults is not None and not client.faults.before_write():
                transfer._on_ack(False, "injected fault", len(runs))
                continue
            if ready_event is not None and self._staging is None:
                ready_event.synchronize()  # the layer's kernels are done before we read its blocks
            with self._lock:
                self._seq += 1
                seq = self._seq
                self._pending[seq] = (transfer, len(runs))
            sid, token = transfer.wire_session
            if notify:
                (run,) = runs
                if transfer.heads is None:
                    notice = wire.Header(wire.KIND_NOTIFY, 0, sid, token, layer, run.dst_block, run.count, seq, 0)
                    buffers: list[bytes | memoryview] = [notice.pack()]
                else:  # head-sliced WRITEs: the range rides in a 4-byte payload
                    n = wire.HEADS.size
                    notice = wire.Header(wire.KIND_NOTIFYH, 0, sid, token, layer, run.dst_block, run.count, seq, n)
                    buffers = [notice.pack() + wire.HEADS.pack(wire.pack_heads(*transfer.heads))]
            else:
                num_ids, packed_ids = self._packed_ids(runs)
                flags = wire.FLAG_MORE if not self._queue.empty() else 0  # its ack can ride on the next frame's
                heads = transfer.heads
                if heads is None:
                    kind, field, nbytes = wire.KIND_WRITEV, 0, num_ids * block_bytes
                else:  # a tensor-parallel rank's share: those heads' K/V slices of each block
                    assert layout is not None, "a head-sliced transfer needs the pool's HeadLayout"
                    kind, field = wire.KIND_WRITEVH, wire.pack_heads(*heads)
                    nbytes = num_ids * layout.slice_bytes(*heads)
                header = wire.Header(kind, flags, sid, token, layer, field, num_ids, seq, nbytes)
                buffers = [header.pack() + packed_ids, *self._payloads(layer, runs, ready_event, heads)]
            try:
                sendmsg_all(sock, buffers)
            except OSError as e:
                self._fail_all(f"connection to {self.endpoint} lost: {e}")
                return
            client.metrics.add_bytes("send", sum(len(b) for b in buffers[1:]))

    def _packed_ids(self, runs: list[Run]) -> tuple[int, bytes]:
        """The WRITEV id list of `runs`, packed once for all the layers that send the same runs object."""
        cached = self._ids_cache
        if cached is not None and cached[0] is runs:
            return cached[1], cached[2]
        ids = [b for r in runs for b in range(r.dst_block, r.dst_block + r.count)]
        self._ids_cache = (runs, len(ids), wire.pack_ids(ids))
        return len(ids), self._ids_cache[2]

    def _payloads(self, layer: int, runs: list[Run], ready_event, heads: tuple[int, int] | None) -> list[memoryview]:
        """The runs' bytes (whole blocks, or the K/V slices of `heads` in each): views of a host pool,
        or one staging copy of a device pool (after ready_event)."""
        client = self.client
        spans = client.source_spans(layer, runs, heads)
        if self._staging is None:
            view = client.region.view
            return [view[o : o + n] for o, n in spans]
        pool = client.region.tensor
        assert pool is not None, "a device region is reached through its tensor"
        return [self._staging.gather(pool, spans, ready_event)]

    def _ack_loop(self) -> None:
        buf = bytearray(wire.HEADER_BYTES)
        view = memoryview(buf)
        sock = self.sock
        assert sock is not None, "acks are read on a connected channel"
        while True:
            try:
                if not recv_exact_into(sock, view):
                    raise OSError("receiver closed the connection")
                h = wire.unpack(view)
            except (OSError, wire.CorruptFrame) as e:
                self._fail_all(f"connection to {self.endpoint} lost: {e}")
                return
            ok = h.status == wire.OK
            with self._lock:  # an OK is cumulative (every frame up to seq landed), a refusal is for one frame
                if ok:
                    done = [(seq, self._pending.pop(seq)) for seq in list(self._pending) if seq <= h.seq]
                else:
                    done = [(h.seq, self._pending.pop(h.seq))] if h.seq in self._pending else []
            for _, (transfer, num_runs) in done:
                transfer._on_ack(
                    ok, "" if ok else f"receiver refused the write ({wire.REASONS.get(h.status)})", num_runs
                )

    def _fail_all(self, reason: str) -> None:
        self.broken = True
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for transfer, num_runs in pending:
            transfer._on_ack(False, reason, num_runs)
        # queued but unsent writes fail too
        for item in self._queue.drain():
            item[0]._on_ack(False, reason, len(item[2]))
        self.close()

    def close(self) -> None:
        """Fail what is queued and wake the threads (a shutdown); the socket itself closes once they
        have let go of it (`_let_go`)."""
        self.broken = True
        self._queue.close()
        with self._lock:
            first, self._closing = not self._closing, True
        sock = self.sock
        if sock is not None:
            shutdown_both(sock)  # wakes the ack thread
        if first:
            self._let_go()
