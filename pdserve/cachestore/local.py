"""In-process transport: a validated memory copy, for tests and single-process clusters."""

from __future__ import annotations

import itertools
import threading

from pdserve.cachestore import wire
from pdserve.cachestore.channel import Receiver, Sender, Transfer
from pdserve.cachestore.geometry import Run

_servers: dict[str, Receiver] = {}
_lock = threading.Lock()
_ids = itertools.count(1)


def register_server(server: Receiver) -> str:
    endpoint = f"local://{next(_ids)}"
    with _lock:
        _servers[endpoint] = server
    return endpoint


def unregister_server(endpoint: str) -> None:
    with _lock:
        _servers.pop(endpoint, None)


class LocalChannel:
    """Copies each run straight into the receiver's pool through the same checks as TCP."""

    broken = False

    def __init__(self, client: Sender, endpoint: str) -> None:
        self.client = client
        self.endpoint = endpoint

    def submit(self, transfer: Transfer, layer: int, run: Run, ready_event) -> None:
        with _lock:
            server = _servers.get(self.endpoint)
        if server is None:
            transfer._on_ack(False, f"no in-process CacheStore receiver at {self.endpoint}")
            return
        if self.client.faults is not None and not self.client.faults.before_write():
            transfer._on_ack(False, "injected fault")
            return
        if ready_event is not None:
            ready_event.synchronize()
        creds, heads = transfer.creds, transfer.heads
        block_ids: range | list[int] = range(run.dst_block, run.dst_block + run.count)
        kind, field, nbytes = wire.KIND_WRITE, run.dst_block, run.count * self.client.geometry.block_bytes
        if heads is not None:  # a tensor-parallel rank's share of each block, as the tcp WRITEVH frame
            spans = self.client.source_spans(layer, [run], heads)
            kind, field, nbytes, block_ids = (
                wire.KIND_WRITEVH,
                wire.pack_heads(*heads),
                sum(n for _, n in spans),
                list(block_ids),
            )
        h = wire.Header(
            kind, 0, bytes.fromhex(creds.session_id), bytes.fromhex(creds.token), layer, field, run.count, 0, nbytes
        )
        session, status, writer = server.begin_write(h, block_ids)
        if session is None:
            server.reject(status)
            transfer._on_ack(False, f"receiver refused the write ({wire.REASONS.get(status)})")
            return
        ok = False
        try:
            if heads is None:
                server.destination(layer, run.dst_block, run.count)[:] = self.client.source(layer, run)
            else:
                src = self.client.region.view
                for dst, (o, n) in zip(server.head_destinations(layer, block_ids, *heads), spans):
                    dst[:] = src[o : o + n]
            ok = True
        finally:
            accepted = server.end_write(session, writer, layer, block_ids, ok, None, heads)
        if not accepted:
            transfer._on_ack(False, "receiver refused the write (session_closed)")
            return
        self.client.metrics.add_bytes("send", nbytes)
        transfer._on_ack(True)

    def submit_layer(self, transfer: Transfer, layer: int, runs: list[Run], ready_event) -> None:
        for run in runs:
            self.submit(transfer, layer, run, ready_event)

    def prepare(self, transfer: Transfer) -> None:
        """Nothing to set up: each write is a checked copy."""

    def close(self) -> None:
        """Nothing to release."""
