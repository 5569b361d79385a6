"""Read a batch input file as raw lines: bytes split on b"\\n" only, each decoded strictly, one at a time.

JSON allows U+2028, U+2029 and U+0085 raw inside strings (and `json.dumps(ensure_ascii=False)`
writes them), so a line is what ends at b"\\n", never what `str.splitlines()` would cut. A line
that is not UTF-8, or longer than the size bound, is still one line: it becomes one error line
under its custom_id when a cheap byte scan recovers one, and the job goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from pdserve.tdpipe.runtime.batch_io import LineError

BOM = b"\xef\xbb\xbf"
DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024
"""A longer line is refused without being held in memory (the HTTP API's body limit is of this order)."""
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*("(?:[^"\\\x00-\x1f]|\\.){1,1024}")')
_SCAN_BYTES = 64 * 1024
"""How much of an unreadable line the custom_id scan looks at."""


@dataclass
class RawLine:
    """One input line: its 1-based number, its text, or the error it is (`text` None then)."""

    line_no: int
    text: str | None
    error: LineError | None = None
    custom_id: str | None = None
    """Recovered by a byte scan when the line cannot be read as a whole (`error` set)."""


def scan_custom_id(raw: bytes) -> str | None:
    """The custom_id a damaged line names, found without parsing the line: the first
    `"custom_id": "..."` in its first 64 KiB whose string decodes (None otherwise)."""
    m = _CUSTOM_ID.search(raw[:_SCAN_BYTES])
    if m is None:
        return None
    try:
        value = json.loads(m.group(1).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, str) and value else None


def _decode(raw: bytes, line_no: int) -> RawLine:
    if line_no == 1 and raw.startswith(BOM):  # a BOM is an encoding mark, not content
        raw = raw[len(BOM) :]
    try:
        return RawLine(line_no, raw.decode("utf-8"))  # strict: the HTTP API answers 400 to invalid UTF-8
    except UnicodeDecodeError as e:
        err = LineError("invalid_encoding", f"line is not valid UTF-8 (byte {e.start}: {e.reason})")
        return RawLine(line_no, None, err, scan_custom_id(raw))


def read_lines(stream: BinaryIO, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[RawLine]:
    """The non-blank lines of `stream`, read one at a time (memory: one line, at most
    `max_line_bytes` of it). Blank lines are skipped but counted, so numbers match the file's."""
    line_no = 0
    while True:
        raw = stream.readline(max_line_bytes + 1)  # binary readline splits on b"\n" only
        if not raw:
            return
        line_no += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            head, size = raw[:_SCAN_BYTES], len(raw)
            while raw and not raw.endswith(b"\n"):  # skip the rest of the line in bounded pieces
                raw = stream.readline(max_line_bytes + 1)
                size += len(raw)
            err = LineError("line_too_long", f"line is {size} bytes; the limit is {max_line_bytes} (--max-line-bytes)")
            yield RawLine(line_no, None, err, scan_custom_id(head))
            continue
        raw = raw[:-1] if raw.endswith(b"\n") else raw
        body = raw[len(BOM) :] if line_no == 1 and raw.startswith(BOM) else raw
        if not body.strip(b" \t\r"):
            continue
        yield _decode(raw, line_no)


def count_lines(name: str) -> int | None:
    """Lines in a local input file, counted in 1 MiB pieces (the progress bar's total); None for a URL."""
    if name.startswith(("http://", "https://")):
        return None
    n, last = 0, b"\n"
    with open(name, "rb") as f:
        while chunk := f.read(1 << 20):
            n, last = n + chunk.count(b"\n"), chunk[-1:]
    return n + (last != b"\n")
