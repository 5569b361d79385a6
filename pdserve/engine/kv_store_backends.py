"""Where the shared KV store (`pdserve.engine.kv_shared_store.SharedKvStore`) keeps its blocks: a
directory (`file:///PATH`) or a Mooncake Store (`mooncake://MASTER`). A backend stores opaque,
self-checking records by name; the store above it does the keying, the checks and the threads."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qs, urlparse

log = logging.getLogger("pdserve.engine")
TRIM_EVERY = 64
"""Writes between two checks of a directory's size against its `max`."""


class BlockBackend(Protocol):
    """Named records shared by every node that reaches the same backend."""

    def exists(self, name: str) -> bool: ...

    def read(self, name: str) -> bytes | None:
        """The record, or None when it is missing or cannot be read (the caller recomputes)."""

    def write(self, name: str, data: bytes) -> bool:
        """Store the record whole or not at all; False when it could not be written."""

    def remove(self, name: str) -> None: ...

    def evicted(self) -> int:
        """Records this node removed to keep the backend within its bound, so far."""

    def describe(self) -> str: ...

    def close(self) -> None: ...


def parse_store_url(url: str) -> tuple[str, str, dict[str, str]]:
    """(scheme, location, options) of `--kv-store`; ValueError naming the flag."""
    parsed = urlparse(url)
    query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
    if parsed.scheme == "file":
        if parsed.netloc or not parsed.path.startswith("/"):
            raise ValueError(f"--kv-store: expected file:///ABSOLUTE/PATH, got {url!r}")
        allowed, location = {"max"}, parsed.path
    elif parsed.scheme == "mooncake":
        if not parsed.netloc:
            raise ValueError(f"--kv-store: expected mooncake://MASTER_HOST:PORT, got {url!r}")
        if parsed.netloc == LOCAL_MASTER:
            raise ValueError(
                "--kv-store mooncake://local: only `pdserve up` starts a master of its own; "
                "give a node mooncake://MASTER_HOST:PORT"
            )
        allowed, location = MOONCAKE_OPTIONS, parsed.netloc
    else:
        raise ValueError(f"--kv-store: expected file:///PATH or mooncake://MASTER_HOST:PORT, got {url!r}")
    unknown = set(query) - allowed
    if unknown:
        raise ValueError(f"--kv-store: unknown option(s) {', '.join(sorted(unknown))} in {url!r}")
    from pdserve.engine.kv_sizing import parse_memory_size

    for name in ("max", "segment", "buffer"):
        if name in query and query[name] != "0":
            try:
                parse_memory_size(query[name])
            except ValueError as e:
                raise ValueError(f"--kv-store: {name}: {e}") from None
    return parsed.scheme, location, query


LOCAL_MASTER = "local"
"""The host of `mooncake://local`: `pdserve up` starts a master of its own for it
(pdserve.commands.local_master); a node refuses it."""

MOONCAKE_OPTIONS = {"protocol", "local_hostname", "metadata", "segment", "buffer", "device"}
"""mooncake:// options (see `kv_mooncake.MooncakeBackend`)."""


def open_backend(url: str) -> BlockBackend:
    """The backend `url` names, ready to use; ValueError naming --kv-store when it cannot be."""
    scheme, location, options = parse_store_url(url)
    if scheme == "mooncake":
        from pdserve.engine.kv_mooncake import MooncakeBackend

        return MooncakeBackend(location, options)
    from pdserve.engine.kv_sizing import parse_memory_size

    return FileBackend(Path(location), parse_memory_size(options["max"]) if "max" in options else None)


class FileBackend:
    """Records as files under `path` (local NVMe or a shared volume: NFS, Lustre, a PVC), each
    written to a temporary file renamed into place (atomic: another node never reads half of one).
    With `max_bytes` the least recently used files beyond it are removed (a read refreshes a
    file's time)."""

    def __init__(self, path: Path, max_bytes: int | None = None) -> None:
        self.path, self.max_bytes = path, max_bytes
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"--kv-store: {path} is not a writable directory ({e})") from e
        self._writes = 0
        self._evicted = 0

    def _file(self, name: str) -> Path:
        return self.path / name[:2] / f"{name}.kvb"

    def exists(self, name: str) -> bool:
        return self._file(name).exists()

    def read(self, name: str) -> bytes | None:
        path = self._file(name)
        try:
            data = path.read_bytes()
            os.utime(path)  # a hit: least recently used last
        except OSError:
            return None  # gone (another node trimmed it), or the volume is down
        return data

    def write(self, name: str, data: bytes) -> bool:
        path = self._file(name)
        if path.exists():
            os.utime(path)
            return True
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("KV store: writing %s failed (%s)", path.name, e)
            tmp.unlink(missing_ok=True)
            return False
        self._writes += 1
        if self.max_bytes and self._writes % TRIM_EVERY == 0:
            self._trim()
        return True

    def remove(self, name: str) -> None:
        self._file(name).unlink(missing_ok=True)

    def evicted(self) -> int:
        return self._evicted

    def _trim(self) -> None:
        """Remove the least recently used files while the directory holds more than `max_bytes`."""
        assert self.max_bytes is not None
        files = []
        for path in self.path.glob("*/*.kvb"):
            try:
                st = path.stat()
            except OSError:
                continue  # removed meanwhile (another node trims too)
            files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
            self._evicted += 1

    def describe(self) -> str:
        limit = f"at most {self.max_bytes / 2**30:.2f} GiB" if self.max_bytes else "no size limit"
        return f"{self.path} ({limit})"

    def close(self) -> None:
        pass
