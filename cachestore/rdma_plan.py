"""What the rdma sender posts: WRITE work requests for coalesced runs, and the key for each."""

from __future__ import annotations

from typing import NamedTuple

from cachestore.geometry import PoolGeometry, Run

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
) -> list[list[WriteRequest]]:
    """Work requests for `runs` of `layer`, batched into chains of at most `max_per_post`."""
    assert local.block_bytes == remote.block_bytes, "geometries disagree on block size"
    wrs = [
        WriteRequest(
            first_wr_id + i,
            local_base + local.offset(layer, r.src_block),
            r.count * local.block_bytes,
            remote_base + remote.offset(layer, r.dst_block),
        )
        for i, r in enumerate(runs)
    ]
    return [wrs[i : i + max_per_post] for i in range(0, len(wrs), max_per_post)]


def plan_head_writes(
    layer: int,
    run: Run,
    heads: tuple[int, int],
    local: PoolGeometry,
    local_base: int,
    remote: PoolGeometry,
    remote_base: int,
    first_wr_id: int = 0,
    max_per_post: int = MAX_WR_PER_POST,
) -> list[list[WriteRequest]]:
    """Work requests for heads [lo, hi) of `run`'s blocks: per block, the K slice and the V slice, each
    from the sender's strided slice straight into the receiver's (both pools state their heads)."""
    src = local.head_spans(layer, range(run.src_block, run.src_block + run.count), *heads)
    dst = remote.head_spans(layer, range(run.dst_block, run.dst_block + run.count), *heads)
    wrs = [
        WriteRequest(first_wr_id + i, local_base + so, n, remote_base + do)
        for i, ((so, n), (do, _)) in enumerate(zip(src, dst))
    ]
    return [wrs[i : i + max_per_post] for i in range(0, len(wrs), max_per_post)]


def window_for(windows: list[list[int]], address: int, length: int) -> int:
    """The rkey of the granted window covering [address, address+length); OSError if none does."""
    for start, size, rkey in windows:
        if start <= address and address + length <= start + size:
            return rkey
    raise OSError(f"no granted window covers {length} bytes at {address:#x}")
