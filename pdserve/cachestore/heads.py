"""KV geometry per tensor-parallel rank: which KV heads a pool holds, and which heads each sending
rank writes into each receiving rank when the two sides' TP degrees differ.

A pool block is [planes][heads held][head_bytes] (`engine.kv_pool`: HND inside a block), so heads
[lo, hi) of one block are one contiguous byte span per plane (the K slice and the V slice): a
head-sliced write lands straight in those strided regions, with no staging copy of the whole block.
Planes are 2 (K, V), or 1 for DeepSeek's latent attention (MLA): one latent "head", both key and
value, which every rank holds whole (1 KV head, replicated), so its blocks always move whole.

Head ranges are absolute (heads of the model, 0 .. total_heads-1). Ranks split the heads evenly; with
fewer heads than ranks each head is replicated on `size / total_heads` ranks (vLLM's rule, the same
arithmetic as `engine.parallel.sharding.kv_head_range`, restated here because cachestore imports
nothing from the engine).
"""

from __future__ import annotations

from dataclasses import dataclass


def rank_heads(total_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of the KV heads rank `rank` of `size` holds; ValueError if they cannot be split."""
    if total_heads <= 0 or size <= 0 or not 0 <= rank < size:
        raise ValueError(f"no KV heads for rank {rank} of {size} with {total_heads} heads")
    if total_heads >= size:
        if total_heads % size:
            raise ValueError(f"{total_heads} KV heads cannot be split over {size} ranks")
        n = total_heads // size
        return rank * n, (rank + 1) * n
    if size % total_heads:
        raise ValueError(f"{size} ranks cannot replicate {total_heads} KV heads evenly")
    head = rank // (size // total_heads)
    return head, head + 1


@dataclass(frozen=True)
class HeadLayout:
    """The KV heads one pool holds: rank `tp_rank` of a `tp_size` group, heads [first, first+count)
    of `total_heads`, each head's K (and V) of one block being `head_bytes` bytes, in `planes`
    planes (2: K and V; 1: an MLA latent)."""

    total_heads: int
    first: int
    count: int
    head_bytes: int
    tp_rank: int = 0
    tp_size: int = 1
    planes: int = 2

    def __post_init__(self) -> None:
        if (self.first, self.first + self.count) != rank_heads(self.total_heads, self.tp_rank, self.tp_size):
            raise ValueError(
                f"heads [{self.first}, {self.first + self.count}) are not rank {self.tp_rank} of "
                f"{self.tp_size}'s share of {self.total_heads} KV heads"
            )
        if self.head_bytes <= 0:
            raise ValueError(f"head_bytes must be positive, got {self.head_bytes}")
        if self.planes not in (1, 2):
            raise ValueError(f"a KV block has 1 or 2 planes, got {self.planes}")

    @classmethod
    def of_rank(cls, total_heads: int, head_bytes: int, rank: int = 0, size: int = 1, planes: int = 2) -> HeadLayout:
        first, stop = rank_heads(total_heads, rank, size)
        return cls(total_heads, first, stop - first, head_bytes, rank, size, planes)

    @property
    def stop(self) -> int:
        return self.first + self.count

    @property
    def block_bytes(self) -> int:
        return self.planes * self.count * self.head_bytes

    def slice_bytes(self, lo: int, hi: int) -> int:
        """Bytes of heads [lo, hi) of one block (every plane: K and V, or the one latent)."""
        return self.planes * (hi - lo) * self.head_bytes

    def spans(self, block_offset: int, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """(offset, length) of the slice of heads [lo, hi) in each plane (K, then V) of the block at
        `block_offset`: one span with one plane."""
        assert self.first <= lo < hi <= self.stop, f"heads [{lo}, {hi}) outside [{self.first}, {self.stop})"
        start = block_offset + (lo - self.first) * self.head_bytes
        n = (hi - lo) * self.head_bytes
        plane = self.count * self.head_bytes
        return tuple((start + p * plane, n) for p in range(self.planes))

    def describe(self) -> str:
        return (
            f"TP rank {self.tp_rank}/{self.tp_size} holding KV heads [{self.first}, {self.stop}) of {self.total_heads}"
        )

    def geometry(self) -> str:
        """The model-level KV geometry (what must match between sender and receiver), for errors."""
        planes = "K and V planes" if self.planes == 2 else "1 plane (MLA latent)"
        return f"{planes} x {self.total_heads} KV heads x {self.head_bytes} bytes a head's block"


def writer_of(total_heads: int, head: int, sender_size: int) -> int:
    """The one sending rank that writes `head` (with replication, the lowest rank holding it)."""
    if total_heads >= sender_size:
        return head // (total_heads // sender_size)
    return head * (sender_size // total_heads)


def assigned_heads(sender: HeadLayout, receiver: HeadLayout) -> tuple[int, int] | None:
    """Heads [lo, hi) that `sender` writes into `receiver` (None: nothing). Every head a receiver holds
    is written by exactly one sending rank, so a session completes once each of its heads landed."""
    heads = [
        h
        for h in range(max(sender.first, receiver.first), min(sender.stop, receiver.stop))
        if writer_of(sender.total_heads, h, sender.tp_size) == sender.tp_rank
    ]
    return (heads[0], heads[-1] + 1) if heads else None


def check_mappable(sender: HeadLayout, receiver: HeadLayout) -> None:
    """ValueError naming why KV of `sender` cannot land in `receiver`, and both geometries. Different
    TP degrees map (a head's bytes are the same whoever holds it); a different model geometry does not."""
    why = _mismatch(sender, receiver)
    if why is not None:
        raise ValueError(
            f"incompatible KV geometry: {why} (sender: {sender.geometry()}; receiver: {receiver.geometry()})"
        )


def _mismatch(sender: HeadLayout, receiver: HeadLayout) -> str | None:
    if sender.planes != receiver.planes:  # K/V against an MLA latent: not the same model's KV
        return f"the sender's blocks have {sender.planes} plane(s), the receiver's {receiver.planes}"
    if sender.total_heads != receiver.total_heads:
        return f"the sender has {sender.total_heads} KV heads, the receiver {receiver.total_heads}"
    if sender.head_bytes != receiver.head_bytes:
        return (
            f"one head of one block is {sender.head_bytes} bytes on the sender, {receiver.head_bytes} on the "
            "receiver (block size, head size or dtype differ: for MLA, the latent width)"
        )
    return None
