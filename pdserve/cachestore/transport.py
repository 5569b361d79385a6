"""Choosing a transport: `auto` takes RDMA when a device exists and otherwise falls back to TCP, loudly."""

from __future__ import annotations

import logging

log = logging.getLogger("pdserve.cachestore")


TRANSPORTS = ("tcp", "rdma", "local", "auto")


def resolve_transport(requested: str) -> str:
    """The transport that will actually run for `requested`."""
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {requested!r}")
    if requested != "auto":
        if requested == "rdma":
            from pdserve.cachestore.rdma_verbs import rdma_devices

            if not rdma_devices():
                raise ValueError(
                    "transport 'rdma' requested but no RDMA device is available (use 'auto' to fall back to tcp)"
                )
        return requested
    from pdserve.cachestore.rdma_verbs import rdma_devices

    devices = rdma_devices()
    if devices:
        return "rdma"
    # A silent fallback to TCP is a known production trap: say it, and the metrics label shows it too.
    log.warning("cachestore transport 'auto': no RDMA device found, falling back to tcp")
    return "tcp"
