"""Choosing a transport: `auto` takes RDMA when a device exists and otherwise falls back to TCP, loudly."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cachestore.client import Transfer
    from cachestore.geometry import Run

log = logging.getLogger("pdserve.cachestore")


class Channel(Protocol):
    """A sender's connection to one receiver; one implementation per transport
    (`local.LocalChannel`, `tcp_sender.TcpChannel`, `rdma.RdmaChannel`). Submitting only enqueues
    (any thread, the engine's included); the channel's own threads send and call the transfer's
    `_on_ack`."""

    broken: bool
    """Set once the channel can send no more; the client replaces it at the next transfer."""

    def submit(self, transfer: Transfer, layer: int, run: Run, ready_event: Any) -> None:
        """Queue one run of `layer` (`ready_event`: a CUDA event to wait on before reading, or None)."""

    def submit_layer(self, transfer: Transfer, layer: int, runs: list[Run], ready_event: Any) -> None:
        """Queue every run of `layer` (as one frame where the transport can)."""

    def close(self) -> None:
        """Stop sending; queued runs fail."""


TRANSPORTS = ("tcp", "rdma", "local", "auto")


def resolve_transport(requested: str) -> str:
    """The transport that will actually run for `requested`."""
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {requested!r}")
    if requested != "auto":
        if requested == "rdma":
            from cachestore.rdma import rdma_devices

            if not rdma_devices():
                raise ValueError(
                    "transport 'rdma' requested but no RDMA device is available (use 'auto' to fall back to tcp)"
                )
        return requested
    from cachestore.rdma import rdma_devices

    devices = rdma_devices()
    if devices:
        return "rdma"
    # A silent fallback to TCP is a known production trap: say it, and the metrics label shows it too.
    log.warning("cachestore transport 'auto': no RDMA device found, falling back to tcp")
    return "tcp"
