"""The TCP wire format: a fixed-size, versioned binary header per frame.

Connection: the server sends a 16-byte nonce; the client answers with
HMAC-SHA256(cluster secret, nonce) (32 bytes). Then the client sends WRITEV
frames (header + block id list + payload; one per layer, whatever the block
layout) or WRITE frames (header + payload of consecutive blocks). The server
answers with ACK frames once the bytes have landed: an OK is cumulative (every
frame up to its seq), a refusal names one frame.
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
KIND_WRITEV = 5
"""One layer, any block layout: header, then `count` destination block ids (uint32, big-endian),
then the payload: the blocks' bytes in the order of the ids. `dst_block` is unused (0)."""
KIND_WRITEVH = 6
"""A WRITEV of some KV heads of each block (tensor-parallel ranks of different degrees): `dst_block`
packs the absolute head range as `first << 16 | count` (`pack_heads`), and the payload is, per listed
block, the K slice then the V slice of those heads. Lands in the receiver's strided head slices."""
KIND_NOTIFYH = 7
"""RDMA: like NOTIFY, for head-sliced WRITEs: a 4-byte payload packs the head range (`pack_heads`)."""
HEADS = struct.Struct("!I")
FLAG_MORE = 1
"""In a WRITE/WRITEV header's status field (sender -> receiver): another frame is already queued right
behind this one, so the receiver may hold this frame's ack and cover it with the next one's (it acks
anyway if that frame does not come within its linger). Receivers that predate it ignore it."""
MAX_CONNECT_BYTES = 4096
MAX_IDS_PER_FRAME = 1 << 16
"""Most block ids one WRITEV frame may list; a larger count marks the stream corrupt."""
IDS = struct.Struct("!I")

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
# 6 is not used (it was an "injected fault" status nothing sent); not reused, so a code keeps one meaning
SESSION_CLOSED = 7
"""The session ended while the write was in flight: its bytes do not count."""
BAD_HEADS = 8
"""A head-sliced write names heads the receiving rank does not hold (or the session has no head geometry)."""
REASONS = {
    UNKNOWN_SESSION: "unknown_session",
    BAD_TOKEN: "bad_token",
    BAD_LAYER: "bad_layer",
    BAD_BLOCK: "bad_block",
    BAD_LENGTH: "bad_length",
    SESSION_CLOSED: "session_closed",
    BAD_HEADS: "bad_heads",
}


class Header(NamedTuple):
    kind: int
    status: int
    session_id: bytes
    token: bytes
    layer: int
    dst_block: int
    count: int  # type: ignore[assignment]  # shadows tuple.count: the frame field's name
    seq: int
    payload_len: int

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC,
            VERSION,
            self.kind,
            self.status,
            self.session_id,
            self.token,
            self.layer,
            self.dst_block,
            self.count,
            self.seq,
            self.payload_len,
        )


class CorruptFrame(Exception):
    """The stream cannot be trusted any more (bad magic/version/kind or oversized length)."""


def unpack(data: bytes | memoryview) -> Header:
    magic, version, kind, status, sid, token, layer, dst, count, seq, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise CorruptFrame("bad magic")
    if version != VERSION:
        raise CorruptFrame(f"unsupported wire version {version}")
    if kind not in (KIND_WRITE, KIND_ACK, KIND_NOTIFY, KIND_CONNECT, KIND_WRITEV, KIND_WRITEVH, KIND_NOTIFYH):
        raise CorruptFrame(f"unknown frame kind {kind}")
    if length > MAX_FRAME_BYTES:
        raise CorruptFrame(f"length field {length} exceeds {MAX_FRAME_BYTES}")
    if kind in (KIND_WRITEV, KIND_WRITEVH) and count > MAX_IDS_PER_FRAME:
        raise CorruptFrame(f"{count} block ids in one frame exceed {MAX_IDS_PER_FRAME}")
    return Header(kind, status, sid, token, layer, dst, count, seq, length)


def pack_heads(lo: int, hi: int) -> int:
    """A WRITEVH header's `dst_block`: heads [lo, hi)."""
    assert 0 <= lo < hi <= 0xFFFF, f"head range [{lo}, {hi}) does not fit a frame"
    return lo << 16 | (hi - lo)


def unpack_heads(field: int) -> tuple[int, int]:
    """[lo, hi) from a WRITEVH header's `dst_block`."""
    lo = field >> 16
    return lo, lo + (field & 0xFFFF)


def pack_ids(block_ids: list[int]) -> bytes:
    return struct.pack(f"!{len(block_ids)}I", *block_ids)


def unpack_ids(data: bytes | memoryview) -> tuple[int, ...]:
    return struct.unpack(f"!{len(data) // IDS.size}I", data)


def auth_tag(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()
