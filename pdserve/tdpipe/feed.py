"""A policy's waiting queue filled on demand, so that a job never holds all its requests at once.

`pdserve batch` streams its input: requests are read, validated and tokenized only when the
policy looks at its waiting queue and the job's window of lines in flight has room. The
policies take a `RequestFeed` where they take a request list: TD-Pipe uses it as its waiting
deque, and PP's virtual engines each get a view (`split`) that draws from the same source.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator

from pdserve.tdpipe.workload import SimRequest

Pull = Callable[[], "SimRequest | None"]
"""The next request, or None when there is none for now (window full) or ever (input done)."""


class RequestFeed(deque):
    """A deque that refills itself from `pull` whenever the policy reads it (len, bool, [0],
    iteration, popleft). What the policy puts back (a preempted request) stays first."""

    def __init__(self, pull: Pull, target: int = 1) -> None:
        super().__init__()
        self._pull, self.target = pull, max(1, target)
        """Fill up to `target` requests at a time (the window bounds it further)."""

    def _fill(self) -> None:
        while deque.__len__(self) < self.target:
            r = self._pull()
            if r is None:
                return
            self.append(r)

    def __len__(self) -> int:
        self._fill()
        return deque.__len__(self)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __getitem__(self, i: Any) -> Any:
        self._fill()
        return deque.__getitem__(self, i)

    def __iter__(self) -> Iterator[Any]:
        self._fill()
        return deque.__iter__(self)

    def popleft(self) -> Any:
        self._fill()
        return deque.popleft(self)

    def split(self, n: int) -> list[RequestFeed]:
        """`n` queues drawing from this feed as each runs dry (PP's virtual engines): an engine
        takes new work when it has room, rather than a fixed share of a list. What this feed has
        already read goes out first: `pdserve batch` reads ahead (to learn whether any line can run
        at all) before the policy splits the feed, and those requests must not be stranded here."""

        def pull() -> SimRequest | None:
            return deque.popleft(self) if deque.__len__(self) else self._pull()

        return [RequestFeed(pull, 1) for _ in range(n)]
