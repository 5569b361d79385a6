"""The queue between `Transfer.write_layer` and a channel's sending thread (a tcp connection or an
rdma lane): layer writes in the order they were accepted, closed by a None."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any


class WriteQueue:
    """Queued layer writes, each a tuple whose first element is its `Transfer`. `put` and `close`
    may be called from any thread; `live` is the sending thread's loop."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: tuple[Any, ...]) -> None:
        self._q.put(item)

    def close(self) -> None:
        """Ends `live` once the writes queued before it are taken."""
        self._q.put(None)

    def empty(self) -> bool:
        return self._q.empty()

    def live(self) -> Iterator[tuple[Any, ...]]:
        """Blocks for each next write, skipping those whose transfer has already failed; returns at close."""
        while (item := self._q.get()) is not None:
            if not item[0].failed:
                yield item

    def drain(self) -> list[tuple[Any, ...]]:
        """Takes every write queued now, without waiting (a close marker among them is dropped)."""
        items: list[tuple[Any, ...]] = []
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return items
            if item is not None:
                items.append(item)
