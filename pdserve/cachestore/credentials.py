"""SessionCredentials: what a sender needs to write into one receiver session."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from pdserve.cachestore.heads import HeadLayout

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
    total_heads: int = 0
    """The model's KV heads; 0: the receiver states no head geometry (whole blocks only)."""
    head_bytes: int = 0
    """One head's K (or V) of one block, in bytes."""
    tp_rank: int = 0
    tp_size: int = 1
    """The receiving rank and its node's tensor-parallel degree: the session expects that rank's heads."""
    planes: int = 2
    """Planes of a block: 2 (K, V), 1 (an MLA latent). Sent only when 1, so that 2-plane credentials
    stay the bytes a node without this field reads (and one without it refuses a 1-plane pool)."""

    def heads(self) -> HeadLayout | None:
        """The KV heads the receiving pool holds (and the session expects), or None if not stated."""
        if not self.total_heads:
            return None
        return HeadLayout.of_rank(self.total_heads, self.head_bytes, self.tp_rank, self.tp_size, self.planes)

    def to_bytes(self) -> bytes:
        fields = asdict(self)
        if self.planes == 2:
            del fields["planes"]
        data = json.dumps(fields, separators=(",", ":")).encode()
        assert len(data) <= MAX_CREDENTIALS_BYTES, "credentials too large"
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> "SessionCredentials":
        if len(data) > MAX_CREDENTIALS_BYTES:
            raise ValueError(f"credentials of {len(data)} bytes exceed {MAX_CREDENTIALS_BYTES}")
        try:
            raw = json.loads(data.decode())
            raw["block_ids"] = tuple(int(b) for b in raw["block_ids"])
            creds = cls(**raw)
            creds.heads()  # a head geometry that cannot exist is refused here
            return creds
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed CacheStore credentials: {e}") from e
