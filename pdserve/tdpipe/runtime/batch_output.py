"""The batch output file: an exclusive lock, `--resume`'s reading of it, and the ordered writer.

Every line is written and flushed as soon as it may be (a SIGKILLed job keeps each finished
line, and `--resume` answers the rest exactly once). In input order, a result that finishes
before an earlier line waits in a reorder buffer; the job bounds that buffer by never having
more than `--max-lines-in-flight` lines read but not yet written (a slow early line therefore
holds back the reading of new lines, not the memory).
"""

from __future__ import annotations

import fcntl
import json
import os
from typing import BinaryIO, Callable

from pdserve.tdpipe.runtime.batch_io import resume_key

ResumeKey = tuple[str, object]
"""("id", custom_id) or ("line", 1-based input line number): see batch_io.resume_key."""


def _lock(f: BinaryIO, path: str) -> None:
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(
            f"{path} is being written by another `pdserve batch` job (it holds the file's lock); "
            f"wait for that job to end, or write to another output file"
        ) from None


def open_output(path: str, resume: bool) -> tuple[BinaryIO, set[ResumeKey]]:
    """The output file opened for appending and locked for this job alone (ValueError, at once,
    when another job holds it), with what it already answers (`--resume`; empty otherwise).
    Without `--resume` a non-empty file is refused: a rerun must not throw results away."""
    f: BinaryIO = open(path, "ab")  # never truncate before holding the lock: the file may be another job's
    _lock(f, path)
    if not resume:
        if os.fstat(f.fileno()).st_size > 0:
            f.close()
            raise ValueError(
                f"{path} already has results: add --resume to finish that job, or remove the file to start over"
            )
        return f, set()
    with open(path, "rb") as r:
        data = r.read()
    done, keep, dropped = set(), [], 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            key = resume_key(json.loads(raw))
        except Exception:  # a torn or garbage line, wherever it sits: dropped, its request redone
            dropped += 1
            continue
        if key is not None:
            done.add(key)
        keep.append(raw)
    if dropped or (data and not data.endswith(b"\n")):
        f = _rewrite(path, f, b"".join(raw + b"\n" for raw in keep))
    return f, done


def _rewrite(path: str, f: BinaryIO, data: bytes) -> BinaryIO:
    """Replace the file with `data` (its valid lines) atomically, then lock the new file: a crash
    leaves the old or the new content whole, and a job that took the new file first wins it."""
    tmp = f"{path}.resume-tmp"
    with open(tmp, "wb") as t:
        t.write(data)
        t.flush()
        os.fsync(t.fileno())
    os.replace(tmp, path)
    f.close()
    f = open(path, "ab")
    _lock(f, path)
    return f


class OrderedWriter:
    """Writes output lines to `f` in input order (`order="input"`) or as they finish
    (`"completion"`). Each input line that will get an output line takes a ticket first."""

    def __init__(self, f: BinaryIO, order: str = "input", on_write: Callable[[dict], None] | None = None) -> None:
        if order not in ("input", "completion"):
            raise ValueError(f"output order must be input or completion, not {order!r}")
        self.f, self.order, self.on_write = f, order, on_write
        self.issued = self.written = 0
        self._next = 0
        self._held: dict[int, dict] = {}

    def ticket(self) -> int:
        """The position of the next input line's output."""
        self.issued += 1
        return self.issued - 1

    @property
    def in_flight(self) -> int:
        """Lines ticketed but not yet written (running, waiting, or held for an earlier line)."""
        return self.issued - self.written

    @property
    def held(self) -> int:
        """Finished lines in the reorder buffer."""
        return len(self._held)

    def put(self, ticket: int, row: dict) -> None:
        """The output line of `ticket`: written now, or once every earlier ticket is."""
        if self.order == "completion":
            self._write(row)
            return
        self._held[ticket] = row
        while self._next in self._held:
            self._write(self._held.pop(self._next))
            self._next += 1

    def _write(self, row: dict) -> None:
        self.f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
        self.f.flush()  # a killed job keeps every finished line (--resume relies on it)
        self.written += 1
        if self.on_write is not None:
            self.on_write(row)
