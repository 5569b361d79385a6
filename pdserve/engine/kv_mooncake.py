"""MooncakeBackend: the shared KV store's records in a Mooncake Store (`--kv-store mooncake://MASTER`).

Mooncake Store (the `mooncake-transfer-engine` wheel; `-non-cuda` on CPU) is a distributed
key-value store: a master (`mooncake_master`) keeps the index, and every client lends memory to a
shared pool (`segment`) that any client reads and writes over TCP or RDMA. Each node is such a
client: the blocks it writes live in some node's lent memory and every node reads them. The master
evicts the oldest unleased records when the pool fills; a write that finds it full is dropped here
(counted by the store) and later ones succeed once it has evicted.

URL options (`mooncake://HOST:PORT?segment=4GiB&buffer=64MiB`): `segment`, the memory this node
lends to the pool (default 1GiB; 0 lends none); `buffer`, its transfer buffer, which bounds one
record (default 64MiB); `protocol` (tcp, or rdma with `device`); `metadata` (default P2PHANDSHAKE:
no metadata service); `local_hostname` (default 127.0.0.1: the address peers reach this node at).

Faults, as observed with mooncake-transfer-engine-non-cuda 0.3.13: errors are return codes, never
exceptions; a dead master makes every call block about 4 s and a hung one until
MC_RPC_TIMEOUT_MS (set to 3000 here unless given), while `health_check` answers at once. So every
call is skipped while the client is unhealthy (a miss, a dropped write), and the store above
bounds reads by its own timeout. A record whose lending node died reads as a miss. Calls on a
closed client crash the process in that version: `close` is fenced by a lock. Its teardown at
process exit can also abort (std::terminate, SIGABRT) once its master has died, even after every
client was closed: a process that opened a client ends through `exit_process`, which the `pdserve`
command calls for every node.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

from pdserve.engine.kv_sizing import parse_memory_size

PREFIX = "pdserve/"
"""Every record's key starts with it: one master may serve other users too."""
DEFAULTS = {"segment": "1GiB", "buffer": "64MiB", "protocol": "tcp", "metadata": "P2PHANDSHAKE"}
CLIENT_ENV = {"MC_RPC_TIMEOUT_MS": "3000", "MC_STORE_CLIENT_SETUP_RETRIES": "2", "MC_LOG_LEVEL": "WARNING"}
"""Set unless the environment has them: bounded calls against a hung master, a start that fails in
seconds (not 90) without one, and no INFO log per call."""
_opened = False
"""Whether this process ever made a Mooncake client (see `exit_process`)."""


def exit_process(code: int) -> int:
    """Ends this process with `code` if it ever opened a Mooncake client; else returns `code`.

    Python's exit handlers run first (every client closes there) and the standard streams are
    flushed; then the process leaves by `os._exit`, skipping the C++ teardown that in 0.3.13 can
    abort with SIGABRT when the master died, so the exit status stays the node's own."""
    if not _opened:
        return code
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to flush into it
            pass
    os._exit(code)


def _size(options: dict[str, str], name: str) -> int:
    text = options.get(name, DEFAULTS[name])
    return 0 if text == "0" else parse_memory_size(text)


class MooncakeBackend:
    """This node's client of the Mooncake Store whose master is at `master` (HOST:PORT)."""

    def __init__(self, master: str, options: dict[str, str]) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError(
                "--kv-store mooncake://: the mooncake package is not installed "
                "(pip install mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda without CUDA)"
            ) from e
        for name, value in CLIENT_ENV.items():
            os.environ.setdefault(name, value)
        self.master = master
        self.segment = _size(options, "segment")
        global _opened
        _opened = True  # even a client whose setup fails has the teardown exit_process avoids
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            options.get("local_hostname", "127.0.0.1"),
            options.get("metadata", DEFAULTS["metadata"]),
            self.segment,
            _size(options, "buffer"),
            options.get("protocol", DEFAULTS["protocol"]),
            options.get("device", ""),
            master,
        )
        if rc != 0:
            raise ValueError(f"--kv-store: the Mooncake master at {master} cannot be used (setup returned {rc})")
        self._lock = threading.Lock()
        self._closed = False
        # a client left open at exit aborts the process when its master is gone (0.3.13): close first
        atexit.register(self.close)

    def _usable(self) -> bool:
        """Under the lock: the client is open and its master answers (0: healthy)."""
        return not self._closed and self.store.health_check() == 0

    def exists(self, name: str) -> bool:
        with self._lock:
            return self._usable() and self.store.is_exist(PREFIX + name) == 1

    def read(self, name: str) -> bytes | None:
        with self._lock:
            data = self.store.get(PREFIX + name) if self._usable() else b""
        return data or None  # b"": missing, its lender gone, or the master down

    def write(self, name: str, data: bytes) -> bool:
        with self._lock:
            return self._usable() and self.store.put(PREFIX + name, data) == 0

    def remove(self, name: str) -> None:
        with self._lock:
            if self._usable():
                self.store.remove(PREFIX + name, True)  # force: a reader's lease must not keep a bad record

    def evicted(self) -> int:
        return 0  # the master evicts, and does not tell its clients

    def describe(self) -> str:
        return f"Mooncake Store at {self.master} (this node lends {self.segment / 2**30:.2f} GiB)"

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.store.close()
