"""What the rdma sender posts: WRITE work requests for coalesced runs, and the key for each."""

from __future__ import annotations

from typing import NamedTuple

from pdserve.cachestore.geometry import PoolGeometry, Run

MAX_WR_PER_POST = 32
"""Work requests chained into one post_send (bounded by the QP's max_send_wr)."""


class WriteRequest(NamedTuple):
    """One RDMA WRITE: `length` bytes from local_addr (lkey) to remote_addr (rkey)."""

    wr_id: int
    local_addr: int
    length: int
    remote_addr: int


def plan_writes(
    layer: int,
    runs: list[Run],
    local: PoolGeometry,
    local_base: int,
    remote: PoolGeometry,
    remote_base: int,
    first_wr_id: int = 0,
    max_per_post: int = MAX_WR_PER_POST,
    heads: tuple[int, int] | None = None,
) -> list[list[WriteRequest]]:
    """Work requests for `runs` of `layer`, batched into chains of at most `max_per_post`. With `heads`
    [lo, hi) (both pools state their heads), two a block: those heads' K slice and V slice, each from
    the sender's strided slice straight into the receiver's."""
    if heads is not None:
        src = local.head_spans(layer, [b for r in runs for b in range(r.src_block, r.src_block + r.count)], *heads)
        dst = remote.head_spans(layer, [b for r in runs for b in range(r.dst_block, r.dst_block + r.count)], *heads)
        pairs = [(so, n, do) for (so, n), (do, _) in zip(src, dst)]
    else:
        assert local.block_bytes == remote.block_bytes, "geometries disagree on block size"
        pairs = [
            (local.offset(layer, r.src_block), r.count * local.block_bytes, remote.offset(layer, r.dst_block))
            for r in runs
        ]
    wrs = [WriteRequest(first_wr_id + i, local_base + so, n, remote_base + do) for i, (so, n, do) in enumerate(pairs)]
    return [wrs[i : i + max_per_post] for i in range(0, len(wrs), max_per_post)]


def window_for(windows: list[list[int]], address: int, length: int) -> int:
    """The rkey of the granted window covering [address, address+length); OSError if none does."""
    for start, size, rkey in windows:
        if start <= address and address + length <= start + size:
            return rkey
    raise OSError(f"no granted window covers {length} bytes at {address:#x}")
