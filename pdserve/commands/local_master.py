"""`pdserve up --kv-store mooncake://local`: a Mooncake master for this cluster only, started by `up`.

A shared KV store needs a master every node reaches. On one machine nobody has one running, so
`up` starts `mooncake_master` (it ships in the mooncake wheel beside its client) on a free
loopback port, hands its nodes `mooncake://127.0.0.1:PORT` with the URL's other options, and stops
it after the nodes (a Mooncake client whose master is gone first aborts at exit in 0.3.13).
The master keeps its RPC and metrics on loopback; it has no authentication, so it serves only
this machine's processes.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

from pdserve.engine.kv_store_backends import LOCAL_MASTER

READY_S = 15.0


def wants_local_master(url: str | None) -> bool:
    if url is None:
        return False
    parsed = urlparse(url)
    return parsed.scheme == "mooncake" and parsed.netloc == LOCAL_MASTER


def master_binary() -> Path:
    """`mooncake_master` of the installed mooncake package; ValueError naming the flag if absent."""
    try:
        import mooncake
    except ImportError:
        raise ValueError(
            "--kv-store mooncake://local: the mooncake package is not installed "
            "(pip install mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda without CUDA)"
        ) from None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.is_file():
        raise ValueError(f"--kv-store mooncake://local: the mooncake package has no master binary ({path})")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalMaster:
    """One `mooncake_master` child on 127.0.0.1 for the lifetime of a `pdserve up`."""

    def __init__(self, url: str) -> None:
        self.binary = master_binary()
        self.query = urlparse(url).query
        self.port = _free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """What the nodes are given."""
        return f"mooncake://127.0.0.1:{self.port}" + (f"?{self.query}" if self.query else "")

    def start(self) -> None:
        """Start the master and wait until it accepts connections; RuntimeError if it does not."""
        loopback = ["--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1", f"--metrics_port={_free_port()}"]
        self.process = subprocess.Popen(
            [str(self.binary), f"--port={self.port}", *loopback, "--enable_metric_reporting=false"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches `up`, which stops the master after the nodes
        )
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with status {self.process.returncode} at start")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on 127.0.0.1:{self.port} within {READY_S:.0f} s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
