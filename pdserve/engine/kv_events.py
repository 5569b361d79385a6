"""KvEventLog: the ordered record of which block keys a node holds, for subscribers.

The block manager appends `stored` when a full block gets its key, `removed` when a
keyed block is evicted, and `cleared` when everything goes. Subscribers (the node's
KvEvents gRPC stream, tests, the trace-replay simulator) read events after a sequence
number, or a snapshot when they are too far behind.

Every event names its medium (`Medium`), as vLLM's KV events do: the pool's events are the
block manager's; the tiers below it add theirs (the host tier when it stores or drops a block,
the shared store when this node writes a block there or finds one gone), so a router can price a
hit by where it lives. One sequence orders them all.

Why a separate object with its own lock: the block manager runs on the engine thread
without locks, while subscribers read from gRPC threads or an event loop. The log
keeps its own copy of the held keys, updated with each event under the lock, so a
snapshot is always consistent with the sequence number it carries. Memory is bounded:
the held set by the pool size, the event buffer by `capacity`.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from typing import NamedTuple

from pdserve.engine.block_keys import BlockKey


class Medium(enum.StrEnum):
    """Where a held block lives (members equal their strings)."""

    POOL = "pool"
    """The engine's KV pool (on the wire: the pool's device, "gpu" or "cpu")."""
    HOST = "host"
    """The node's host tier (--kv-offloading-size)."""
    STORE = "store"
    """The shared store (--kv-store): readable by every node with the same KV compatibility."""


TIER_KEYS_HELD = 1 << 20
"""Keys a log remembers per tier medium at most (oldest forgotten first, without an event). The
store outlives and outgrows one node; forgetting only makes a router under-estimate a hit."""


class KvEventKind(enum.IntEnum):
    """Matches pdserve.v1.KvEvent.Kind values."""

    STORED = 1
    REMOVED = 2
    CLEARED = 3


class KvEvent(NamedTuple):
    """One change: `keys` stored (chained on `parent_key`), removed, or all cleared."""

    seq: int
    kind: KvEventKind
    keys: tuple[BlockKey, ...]
    parent_key: BlockKey = 0
    medium: Medium = Medium.POOL


class KvSnapshot(NamedTuple):
    """Every key held as of `seq`: in the pool (`keys`), and in each tier below it."""

    seq: int
    keys: frozenset[BlockKey]
    tiers: dict[Medium, frozenset[BlockKey]] = {}


class KvEventLog:
    """Bounded, thread-safe log of KV events with gap-free sequence numbers from 1."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._held: dict[Medium, dict[BlockKey, None]] = {m: {} for m in Medium}
        """Held keys by medium, oldest first (dicts keep insertion order)."""
        self._seq = 0
        self._cond = threading.Condition()

    @property
    def seq(self) -> int:
        """Sequence number of the last event (0 before any)."""
        return self._seq

    def stored(self, keys: list[BlockKey], parent_key: BlockKey, medium: Medium = Medium.POOL) -> None:
        if keys:
            self._append(KvEventKind.STORED, tuple(keys), parent_key, medium)

    def removed(self, keys: list[BlockKey], medium: Medium = Medium.POOL) -> None:
        if keys:
            self._append(KvEventKind.REMOVED, tuple(keys), 0, medium)

    def cleared(self) -> None:
        """The pool dropped every block (the tiers keep theirs)."""
        self._append(KvEventKind.CLEARED, (), 0, Medium.POOL)

    def _append(self, kind: KvEventKind, keys: tuple[BlockKey, ...], parent_key: BlockKey, medium: Medium) -> None:
        with self._cond:
            self._seq += 1
            self._events.append(KvEvent(self._seq, kind, keys, parent_key, medium))
            held = self._held[medium]
            if kind is KvEventKind.STORED:
                held.update(dict.fromkeys(keys))
                while len(held) > TIER_KEYS_HELD:  # only tiers grow so far: the pool is bounded by its blocks
                    del held[next(iter(held))]
            elif kind is KvEventKind.REMOVED:
                for key in keys:
                    held.pop(key, None)
            else:
                held.clear()
            self._cond.notify_all()

    def snapshot(self) -> KvSnapshot:
        with self._cond:
            tiers: dict[Medium, frozenset[BlockKey]] = {
                m: frozenset(keys) for m, keys in self._held.items() if m is not Medium.POOL and keys
            }
            return KvSnapshot(self._seq, frozenset(self._held[Medium.POOL]), tiers)

    def since(self, after_seq: int) -> list[KvEvent] | None:
        """Events with seq > after_seq, or None when some of them are no longer buffered
        (or `after_seq` is from the future): the caller then needs a snapshot."""
        with self._cond:
            return self._since_locked(after_seq)

    def wait(self, after_seq: int, timeout: float) -> list[KvEvent] | None:
        """Like `since`, but waits up to `timeout` seconds for at least one event."""
        with self._cond:
            self._cond.wait_for(lambda: self._seq != after_seq, timeout)
            return self._since_locked(after_seq)

    def _since_locked(self, after_seq: int) -> list[KvEvent] | None:
        if after_seq > self._seq:
            return None
        if after_seq == self._seq:
            return []
        oldest = self._events[0].seq if self._events else self._seq + 1
        if after_seq + 1 < oldest:
            return None
        return [e for e in self._events if e.seq > after_seq]
