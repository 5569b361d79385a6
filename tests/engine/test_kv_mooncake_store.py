"""The shared KV store over a real Mooncake Store (`--kv-store mooncake://MASTER`): Mooncake's own
`mooncake_master` (from the mooncake-transfer-engine-non-cuda wheel, scripts/install_mooncake.sh)
runs in a network namespace of its own, with the engines that use it (tests/engine/mooncake_worker.py):
one engine restores what another computed, a corrupt record is refused and recomputed, and a dead
master costs a recompute in bounded time, never a hang or a wrong token. Skipped where the wheel or
network namespaces (root) are missing."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORT = 50051


def master_binary() -> Path | None:
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    return path if path.exists() else None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        master_binary() is None or os.geteuid() != 0 or shutil.which("ip") is None,
        reason="needs the mooncake wheel (scripts/install_mooncake.sh) and root for a network namespace",
    ),
]


@pytest.fixture
def namespace():
    name = f"pdserve-mc-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def start_master(namespace: str) -> subprocess.Popen:
    flags = ["--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1", "--enable_metric_reporting=false"]
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace, str(master_binary()), f"--port={PORT}", *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_port(namespace: str) -> None:
    probe = (
        "import socket, time\nfor _ in range(200):\n"
        f" try: socket.create_connection(('127.0.0.1', {PORT}), 0.2).close(); break\n"
        " except OSError: time.sleep(0.05)"
    )
    subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", probe], check=True, timeout=30)


class Phases:
    """The worker's JSON lines, read on a thread (a select on a buffered pipe would miss lines
    already in the buffer)."""

    def __init__(self, worker: subprocess.Popen) -> None:
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(worker,), daemon=True).start()

    def _read(self, worker: subprocess.Popen) -> None:
        assert worker.stdout is not None
        for line in worker.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def next(self, timeout: float = 120.0) -> dict:
        try:
            phase = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("the worker did not report in time") from None
        assert phase is not None, "the worker ended before reporting"
        return phase


def test_engines_share_kv_through_a_mooncake_store(namespace, tiny_model_dir, tmp_path):
    master = start_master(namespace)
    log = open(tmp_path / "worker.log", "w+")
    worker = None
    try:
        wait_port(namespace)
        url = f"mooncake://127.0.0.1:{PORT}?segment=64MiB&buffer=16MiB"
        worker = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                namespace,
                sys.executable,
                "-m",
                "tests.engine.mooncake_worker",
                str(tiny_model_dir),
                url,
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "MC_LOG_LEVEL": "ERROR"},
        )
        phases = Phases(worker)
        restore = phases.next()
        assert restore["first"] == restore["second"] == restore["reference"]
        assert restore["a"]["stored_blocks"] >= 15
        assert restore["b"]["restored_blocks"] == 15 and restore["b"]["hit_requests"] == 1

        corrupt = phases.next()
        assert corrupt["tokens"] == restore["reference"]
        assert corrupt["c"]["corrupt_blocks"] == 1 and corrupt["c"]["restore_failures"] == 1

        assert phases.next()["phase"] == "kill"
        master.kill()
        master.wait(10)
        assert worker.stdin is not None
        worker.stdin.write("killed\n")
        worker.stdin.flush()
        dead = phases.next()
        assert len(dead["tokens"]) == 4 and dead["seconds"] < 60  # recomputed, not hung
        assert dead["b"]["restored_blocks"] == 15  # nothing more came from a dead store
        assert phases.next()["phase"] == "closed"
        assert worker.wait(30) == 0
    finally:
        for proc in (worker, master):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        log.seek(0)
        print(log.read()[-4000:])  # shown when the test fails
        log.close()
