"""SessionCredentials: what a sender needs to write into one receiver session."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

MAX_CREDENTIALS_BYTES = 64 * 1024


@dataclass(frozen=True)
class SessionCredentials:
    """Issued by CacheStoreServer.open_session; travels to the sender inside a gRPC message."""

    request_id: str
    endpoint: str
    """host:port of the receiver's TCP/control listener, or local://<id> in-process."""
    transport: str
    """tcp | local | rdma"""
    session_id: str
    """Random hex id of the session (frames name it)."""
    token: str
    """Random hex secret of the session (frames must carry it)."""
    num_layers: int
    block_bytes: int
    block_ids: tuple[int, ...]
    """Destination blocks; the sender's i-th source block lands in block_ids[i]."""
    rdma: dict = field(default_factory=dict)
    """RDMA only: the receiver pool's base address and num_blocks (keys come per QP through a grant)."""

    def to_bytes(self) -> bytes:
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        assert len(data) <= MAX_CREDENTIALS_BYTES, "credentials too large"
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> "SessionCredentials":
        if len(data) > MAX_CREDENTIALS_BYTES:
            raise ValueError(f"credentials of {len(data)} bytes exceed {MAX_CREDENTIALS_BYTES}")
        try:
            raw = json.loads(data.decode())
            raw["block_ids"] = tuple(int(b) for b in raw["block_ids"])
            return cls(**raw)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed CacheStore credentials: {e}") from e
