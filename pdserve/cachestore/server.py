"""CacheStoreServer: the receiver (decode side) — session registry plus transport listeners."""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pdserve.cachestore import wire
from pdserve.cachestore.credentials import SessionCredentials
from pdserve.cachestore.faults import FaultInjector
from pdserve.cachestore.geometry import MemoryRegion, PoolGeometry
from pdserve.cachestore.heads import HeadLayout
from pdserve.cachestore.metrics import CacheStoreMetrics
from pdserve.cachestore.session import Session, SessionState
from pdserve.cachestore.tcp_listener import TcpLimits
from pdserve.cachestore.tls import LinkTLS
from pdserve.cachestore.transport import Transport, resolve_transport

if TYPE_CHECKING:  # both load on start() for their transport
    from pdserve.cachestore.rdma_access import RdmaReceiver
    from pdserve.cachestore.tcp_listener import TcpListener

log = logging.getLogger("pdserve.cachestore")
MAX_GRANTS_PER_SESSION = 64
"""RDMA grants one session may hold (one per sender QP is the norm): bounds the windows a peer
holding the token can make the receiver bind."""


class CacheStoreServer:
    """Owns the sessions of one pool and the listener that writes into it.

    `open_session` hands out credentials; every inbound write is checked
    against them (known session, token, layer range, block ownership, exact
    length, bounded frame) before a single byte lands, and refused writes are
    counted by reason. Sessions are keyed by request id and expire after their
    timeout (a timer per session, no polling).
    """

    def __init__(
        self,
        region: MemoryRegion,
        geometry: PoolGeometry,
        transport: str = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | str = b"",
        registry: CollectorRegistry | None = None,
        faults: FaultInjector | None = None,
        model_name: str = "unknown",
        tcp_limits: TcpLimits | None = None,
        tls: LinkTLS | None = None,
        metrics: CacheStoreMetrics | None = None,
    ) -> None:
        if len(region) < geometry.total_bytes:
            raise ValueError(
                f"memory region of {len(region)} bytes is smaller than the pool geometry ({geometry.total_bytes} bytes)"
            )
        self.region = region
        self.geometry = geometry
        self.active_transport = resolve_transport(transport)
        self.host, self.port = host, port
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.metrics = metrics or CacheStoreMetrics(self.active_transport, registry, model_name)
        """`metrics`: another endpoint's over the same pool (a node that both sends and receives)."""
        self.faults = faults
        self.tcp_limits = tcp_limits
        self.tls = tls
        self.metrics.tls.set(1 if tls else 0)
        """Mutual TLS on the TCP links (data and rdma control), or None: plaintext with the HMAC handshake."""
        self.on_listener_change: Callable[[bool], None] | None = None
        """Called (from the listener's thread) when the listener stops or resumes accepting."""
        self._lock = threading.Lock()
        self._by_request: dict[str, Session] = {}
        self._by_id: dict[bytes, Session] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._listener: TcpListener | None = None
        self._rdma: RdmaReceiver | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.endpoint = ""

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.active_transport == Transport.LOCAL:
            from pdserve.cachestore.local import register_server

            self.endpoint = register_server(self)
        else:  # tcp, and rdma's control channel
            if self.active_transport == Transport.RDMA:
                from pdserve.cachestore.rdma_access import RdmaReceiver
                from pdserve.cachestore.rdma_verbs import device_choice

                self._rdma = RdmaReceiver(self, *device_choice())
            from pdserve.cachestore.tcp_listener import TcpListener

            listener = self._listener = TcpListener(self, self.host, self.port, self.tcp_limits, self.tls)
            self.endpoint = listener.start()
        log.info("cachestore receiver on %s (transport=%s)", self.endpoint, self.active_transport)

    async def stop(self) -> None:
        for request_id in list(self._by_request):
            self.close_session(request_id)
        if self._listener is not None:
            self._listener.stop()
        if self._rdma is not None:
            self._rdma.close()
        if self.active_transport == Transport.LOCAL:
            from pdserve.cachestore.local import unregister_server

            unregister_server(self.endpoint)

    # --- sessions -----------------------------------------------------------------------
    def open_session(
        self, request_id: str, block_ids: list[int], num_layers: int | None = None, timeout: float = 30.0
    ) -> SessionCredentials:
        """Accept writes of `num_layers` x `block_ids` for `request_id` until `timeout` seconds pass."""
        num_layers = self.geometry.num_layers if num_layers is None else num_layers
        if not 0 < num_layers <= self.geometry.num_layers:
            raise ValueError(f"num_layers {num_layers} outside 1..{self.geometry.num_layers}")
        if not block_ids or len(set(block_ids)) != len(block_ids):
            raise ValueError("block_ids must be a non-empty list of distinct blocks")
        if min(block_ids) < 0 or max(block_ids) >= self.geometry.num_blocks:
            raise ValueError(f"block ids must be in [0, {self.geometry.num_blocks})")
        heads = self.geometry.heads
        rdma: dict[str, int] = {}
        if self._rdma is not None:  # the pool's layout; the keys come per sender QP (`rdma_access`)
            rdma = {"address": self._rdma.remote_base, "num_blocks": self.geometry.num_blocks}
        creds = SessionCredentials(
            request_id=request_id,
            endpoint=self.endpoint,
            transport=self.active_transport,
            session_id=secrets.token_hex(16),
            token=secrets.token_hex(16),
            num_layers=num_layers,
            block_bytes=self.geometry.block_bytes,
            block_ids=tuple(block_ids),
            rdma=rdma,
            total_heads=heads.total_heads if heads else 0,
            head_bytes=heads.head_bytes if heads else 0,
            tp_rank=heads.tp_rank if heads else 0,
            tp_size=heads.tp_size if heads else 1,
            planes=heads.planes if heads else 2,
        )
        session = Session(creds, self.geometry, timeout, self._loop)
        with self._lock:
            if request_id in self._by_request:
                raise ValueError(f"a CacheStore session for request {request_id!r} is already open")
            self._by_request[request_id] = session
            self._by_id[bytes.fromhex(creds.session_id)] = session
        if self._loop is not None:
            self._timers[request_id] = self._loop.call_later(timeout, self._expire, request_id)
        return creds

    def get_session(self, request_id: str) -> Session | None:
        with self._lock:
            return self._by_request.get(request_id)

    def close_session(self, request_id: str, state: SessionState = SessionState.CLOSED) -> Session | None:
        """Release by request id: no new write can start, and every write still in flight is cut off
        (its connection shut down) so that `wait_safe_to_reuse` resolves promptly; a cut write is
        never acknowledged."""
        with self._lock:
            session = self._by_request.pop(request_id, None)
            cuts = []
            if session is not None:
                self._by_id.pop(bytes.fromhex(session.creds.session_id), None)
                was_open = session.state == SessionState.OPEN
                cuts = session.end(state)
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        if session is not None:
            if was_open:
                (self.metrics.expired if state == SessionState.EXPIRED else self.metrics.failed).inc()
            self._revoke_grants(session)
            if cuts:
                log.warning(
                    "cachestore session %s ended with %d writer(s) inside its blocks: cutting them off",
                    request_id,
                    len(cuts),
                )
                self.metrics.fenced.inc(len(cuts))
            for cut in cuts:
                cut()
        return session

    def _expire(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        session = self.get_session(request_id)
        if session is not None and session.state == SessionState.OPEN:
            log.warning("cachestore session %s expired", request_id)
            self.close_session(request_id, SessionState.EXPIRED)

    @property
    def listening(self) -> bool:
        """Whether new senders can connect (False while accept() is failing, e.g. out of fds)."""
        return self.active_transport == Transport.LOCAL or (self._listener is not None and self._listener.up)

    def listener_changed(self, up: bool) -> None:
        if self.on_listener_change is not None:
            self.on_listener_change(up)

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._by_request)

    # --- the write path (any transport) ------------------------------------------------------
    def check_header(self, h: wire.Header) -> int:
        """The wire status of a write header on its own (before its block id list is read)."""
        with self._lock:
            return self._check_header(h)[1]

    def _check_header(self, h: wire.Header, heads: tuple[int, int] | None = None) -> tuple[Session | None, int]:
        """Every field of a write header, by arithmetic only: nothing is allocated or iterated whose
        size a peer chooses. `count` is bounded by the session's own blocks, the payload length must
        be exactly `count` blocks, and a consecutive range (WRITE, NOTIFY) must lie inside the session,
        checked by two lookups in its sorted ids. Called with the registry lock held."""
        session = self._by_id.get(h.session_id)
        if session is None:
            return None, wire.UNKNOWN_SESSION
        if not secrets.compare_digest(h.token, session.token):
            return None, wire.BAD_TOKEN
        if not 0 <= h.layer < session.creds.num_layers:
            return None, wire.BAD_LAYER
        if not 0 < h.count <= len(session.block_set):
            return None, wire.BAD_BLOCK
        if h.kind == wire.KIND_WRITEVH:
            heads = wire.unpack_heads(h.dst_block)
        per_block = self.geometry.block_bytes
        if heads is not None:  # some heads of each block: they must be this rank's
            layout = session.heads
            if layout is None or not layout.first <= heads[0] < heads[1] <= layout.stop:
                return None, wire.BAD_HEADS
            per_block = layout.slice_bytes(*heads)
        if h.payload_len != h.count * per_block:
            return None, wire.BAD_LENGTH
        if h.kind not in (wire.KIND_WRITEV, wire.KIND_WRITEVH) and not session.owns_range(h.dst_block, h.count):
            return None, wire.BAD_BLOCK
        return session, wire.OK

    def begin_write(
        self,
        h: wire.Header,
        block_ids: Sequence[int],
        cut: Callable[[], None] | None = None,
        heads: tuple[int, int] | None = None,
    ) -> tuple[Session | None, int, int]:
        """Validate a write of `h.payload_len` bytes into `block_ids` of layer `h.layer`: the header
        first (`_check_header`), then the ids, which must be `h.count` distinct blocks of the session
        (a WRITE's or NOTIFY's are the range the header names). On success the session counts one more
        active writer, which `cut` stops if the session ends first. Returns (session or None, wire
        status, writer id)."""
        with self._lock:
            session, status = self._check_header(h, heads)
            if session is None:
                return None, status, -1
            if len(block_ids) != h.count:  # a WRITEV's list is the length its header says (<= the session's blocks)
                return None, wire.BAD_BLOCK, -1
            if not isinstance(block_ids, range):
                owned = session.block_set
                if len(set(block_ids)) != len(block_ids) or any(b not in owned for b in block_ids):
                    return None, wire.BAD_BLOCK, -1
            elif block_ids != range(h.dst_block, h.dst_block + h.count):
                return None, wire.BAD_BLOCK, -1
            return session, wire.OK, session.begin_write(cut)

    def end_write(
        self,
        session: Session,
        writer: int,
        layer: int,
        block_ids: Sequence[int],
        ok: bool,
        wakes: list[Session] | None = None,
        heads: tuple[int, int] | None = None,
    ) -> bool:
        """The writer is out of the blocks. True if the write counts (acknowledge it OK); False if it
        failed or the session ended meanwhile (refuse it).

        `wakes`: where to put the session if its owner must be woken, for the caller to `signal()` once
        its ack is sent (waking the event loop first would put the owner's work ahead of the ack on a
        busy machine); None: woken here."""
        with self._lock:
            accepted, completed, wake = session.end_write(writer, layer, block_ids, ok, heads)
        if wake:
            if wakes is None:
                session.signal()
            else:
                wakes.append(session)
        if accepted:
            per_block = self.geometry.block_bytes if heads is None else self._layout.slice_bytes(*heads)
            self.metrics.add_bytes("recv", len(block_ids) * per_block)
        elif ok:
            self.reject("session_closed")
        if completed:
            assert session.completed_at is not None
            self.metrics.all_layers.observe(session.completed_at - session.opened_at)
            if session.first_layer_at is not None:
                self.metrics.first_layer.observe(session.first_layer_at - session.opened_at)
        return accepted

    def destination(self, layer: int, first_block: int, count: int) -> memoryview:
        """The pool bytes of `count` consecutive blocks of one layer (a validated write lands there)."""
        start = self.geometry.offset(layer, first_block)
        return self.region.view[start : start + count * self.geometry.block_bytes]

    @property
    def _layout(self) -> HeadLayout:
        assert self.geometry.heads is not None, "a head-sliced write was accepted: the pool has a head layout"
        return self.geometry.heads

    def head_destinations(self, layer: int, block_ids: Sequence[int], lo: int, hi: int) -> list[memoryview]:
        """The K and V slices (one latent slice with one plane) of heads [lo, hi) of each block (a
        validated head-sliced write lands there)."""
        view = self.region.view
        return [view[o : o + n] for o, n in self.geometry.head_spans(layer, block_ids, lo, hi)]

    # --- rdma: per-session remote keys (`cachestore.rdma_access`) ----------------------------
    def rdma_control(self, conn, hello: bytes) -> tuple[int, bytes]:
        """A CONNECT message of the rdma transport (QP exchange or grant request)."""
        assert self._rdma is not None, "CONNECT frames are accepted only by an rdma receiver"
        return self._rdma.control(conn, hello)

    def rdma_landed(self, layer: int, block_ids: Sequence[int], heads: tuple[int, int] | None = None) -> None:
        """A validated NOTIFY: make the WRITEs it reports visible in the pool (`RdmaReceiver.landed`)."""
        assert self._rdma is not None, "NOTIFY frames are accepted only by an rdma receiver"
        self._rdma.landed(layer, block_ids, heads)

    def check_grant(self, session_id: str, token: str) -> tuple[Session | None, int]:
        """The open session a grant request names, if its token matches."""
        with self._lock:
            session = self._by_id.get(bytes.fromhex(session_id)) if len(session_id) == 32 else None
            if session is None:
                return None, wire.UNKNOWN_SESSION
            if not secrets.compare_digest(token.encode(), session.creds.token.encode()):
                return None, wire.BAD_TOKEN
            return session, wire.OK

    def add_grant(self, session: Session, revoke: Callable[[], None]) -> bool:
        """Register a bound grant; False if the session closed meanwhile or already holds
        MAX_GRANTS_PER_SESSION (one per sender QP is the norm), and the caller revokes it."""
        with self._lock:
            if session.closed or len(session.grants()) >= MAX_GRANTS_PER_SESSION:
                return False
            session.add_grant(revoke)
            return True

    def _revoke_grants(self, session: Session) -> None:
        """Invalidate the session's remote keys off the event loop; wait_safe_to_reuse waits for it."""
        grants = session.grants()
        if not grants:
            return

        def revoke_all() -> None:
            for grant_id, revoke in grants:
                try:
                    revoke()
                except Exception:  # never leave the session unreusable: the key is freed either way
                    log.exception("revoking an RDMA grant of session %s failed", session.request_id)
                with self._lock:
                    session.end_grant(grant_id)

        threading.Thread(target=revoke_all, name="cachestore-revoke", daemon=True).start()

    def reject(self, status: int | str) -> None:
        """Count a refused frame or connection by reason (a wire status code or a name)."""
        self.metrics.reject(status if isinstance(status, str) else wire.REASONS.get(status, "corrupt"))
