"""Members listed in a JSON file that another process rewrites: `pdserve up --planner slo` lists the
nodes it starts and stops there, and its router (`--discovery file --members-file PATH`) re-reads
the file whenever it changes.

The file is `{"prefill": ["HOST:PORT", ...], "decode": [...]}`; `write_members` replaces it
atomically (a temporary file renamed over it), so a reader never sees half of it. A file that cannot
be read or parsed later keeps the last good view: discovery never empties a running cluster.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable

from pdserve.node_runtime.discovery.base import ROLES, Discovery, DiscoveryError, Member

log = logging.getLogger("pdserve.discovery")


def parse_members(text: str, path: str) -> list[Member]:
    """The members a file's `text` lists; ValueError naming the file when it is not the expected shape."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--members-file {path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or not set(data) <= set(ROLES):
        raise ValueError(f'--members-file {path}: expected {{"prefill": [HOST:PORT, ...], "decode": [...]}}')
    members = []
    for role in ROLES:
        addresses = data.get(role, [])
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ValueError(f"--members-file {path}: {role} must be a list of HOST:PORT strings")
        members += [Member.parse(role, a) for a in addresses]
    return members


def write_members(path: str, prefill: Iterable[str], decode: Iterable[str]) -> None:
    """Replace the file at `path` with these addresses, atomically."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".members-", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"prefill": list(prefill), "decode": list(decode)}, f)
    os.replace(tmp, path)


class FileDiscovery(Discovery):
    """The members of a JSON file, re-read when its modification time or size changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._members: list[Member] = []
        self._seen: tuple[int, int, int] | None = None

    async def check(self) -> None:
        """The file must exist and parse at start: a typo in --members-file is not an empty cluster."""
        try:
            with open(self.path, encoding="utf-8") as f:
                parse_members(f.read(), self.path)
        except OSError as e:
            raise DiscoveryError(f"cannot read --members-file {self.path}: {e.strerror}") from None
        except ValueError as e:
            raise DiscoveryError(str(e)) from None

    def members(self, role: str) -> list[Member]:
        self._reload()
        return [m for m in self._members if m.role == role]

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
            if seen == self._seen:
                return
            with open(self.path, encoding="utf-8") as f:
                self._members = parse_members(f.read(), self.path)
            self._seen = seen
        except (OSError, ValueError) as e:
            if self._seen != (-1, -1, -1):  # once per bad spell, not every refresh
                log.warning("keeping the last members: %s", e)
            self._seen = (-1, -1, -1)
