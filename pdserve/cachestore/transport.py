"""Choosing a transport: `auto` takes RDMA when a device exists and otherwise falls back to TCP, loudly."""

from __future__ import annotations

import enum
import logging

log = logging.getLogger("pdserve.cachestore")


class Transport(enum.StrEnum):
    """How a CacheStore moves KV. Members equal their strings, so configs and credentials that
    carry the plain name compare equal to them."""

    TCP = "tcp"
    RDMA = "rdma"
    LOCAL = "local"
    """Both ends in one process (tests through the Python API)."""
    AUTO = "auto"
    """RDMA where a device exists, else TCP (said in a warning)."""


TRANSPORTS = tuple(t.value for t in Transport)


def resolve_transport(requested: str) -> Transport:
    """The transport that will actually run for `requested`."""
    if requested not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {requested!r}")
    if requested != Transport.AUTO:
        if requested == Transport.RDMA:
            from pdserve.cachestore.rdma_verbs import rdma_devices

            if not rdma_devices():
                raise ValueError(
                    "transport 'rdma' requested but no RDMA device is available (use 'auto' to fall back to tcp)"
                )
        return Transport(requested)
    from pdserve.cachestore.rdma_verbs import rdma_devices

    devices = rdma_devices()
    if devices:
        return Transport.RDMA
    # A silent fallback to TCP is a known production trap: say it, and the metrics label shows it too.
    log.warning("cachestore transport 'auto': no RDMA device found, falling back to tcp")
    return Transport.TCP
