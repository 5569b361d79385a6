"""The TCP wire format: a fixed-size, versioned binary header per frame.

Connection: the server sends a 16-byte nonce; the client answers with
HMAC-SHA256(cluster secret, nonce) (32 bytes). Then the client sends WRITE
frames (header + payload) and the server answers each with an ACK frame.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import NamedTuple

MAGIC = b"PDKV"
VERSION = 1
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_FRAME_BYTES = 256 * 1024 * 1024
"""Largest payload one frame may carry; a bigger length field marks the stream corrupt."""

KIND_WRITE = 1
"""Header + payload: the payload lands in the destination blocks."""
KIND_ACK = 2
"""Receiver -> sender: status of one WRITE/NOTIFY (same seq)."""
KIND_NOTIFY = 3
"""RDMA: the sender already wrote the blocks with RDMA WRITE; no payload follows."""
KIND_CONNECT = 4
"""RDMA: QP info exchange right after the handshake (JSON payload, both directions)."""
MAX_CONNECT_BYTES = 4096

# magic, version, kind, status, session_id (16 bytes), token (16 bytes), layer, dst_block, count, seq, payload_len
HEADER = struct.Struct("!4sBBH16s16sIIIIQ")
HEADER_BYTES = HEADER.size

# ACK status codes (also rejection reasons)
OK = 0
UNKNOWN_SESSION = 1
BAD_TOKEN = 2
BAD_LAYER = 3
BAD_BLOCK = 4
BAD_LENGTH = 5
INJECTED_FAULT = 6
SESSION_CLOSED = 7
"""The session ended while the write was in flight: its bytes do not count."""
REASONS = {UNKNOWN_SESSION: "unknown_session", BAD_TOKEN: "bad_token", BAD_LAYER: "bad_layer",
           BAD_BLOCK: "bad_block", BAD_LENGTH: "bad_length", INJECTED_FAULT: "injected_fault",
           SESSION_CLOSED: "session_closed"}


class Header(NamedTuple):
    kind: int
    status: int
    session_id: bytes
    token: bytes
    layer: int
    dst_block: int
    count: int
    seq: int
    payload_len: int

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.kind, self.status, self.session_id, self.token, self.layer,
                           self.dst_block, self.count, self.seq, self.payload_len)


class CorruptFrame(Exception):
    """The stream cannot be trusted any more (bad magic/version/kind or oversized length)."""


def unpack(data: bytes | memoryview) -> Header:
    magic, version, kind, status, sid, token, layer, dst, count, seq, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise CorruptFrame("bad magic")
    if version != VERSION:
        raise CorruptFrame(f"unsupported wire version {version}")
    if kind not in (KIND_WRITE, KIND_ACK, KIND_NOTIFY, KIND_CONNECT):
        raise CorruptFrame(f"unknown frame kind {kind}")
    if length > MAX_FRAME_BYTES:
        raise CorruptFrame(f"length field {length} exceeds {MAX_FRAME_BYTES}")
    return Header(kind, status, sid, token, layer, dst, count, seq, length)


def auth_tag(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()
