"""`pdserve up` hands each node process its share of the cores (`--num-threads auto`, the default):
the thread count on its command line and, where the cores suffice, its own CPU set."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from pdserve.commands.core_split import node_shares
from tests.e2e.router_cluster import free_port
from tests.e2e.up_process import start_up

pytestmark = pytest.mark.e2e


def cpus_of(pid: int) -> frozenset[int]:
    return frozenset(os.sched_getaffinity(pid))


def test_up_passes_each_node_its_threads_and_pins_it(tiny_model_dir):
    port = free_port()
    args = ["--port", str(port), "--model", str(tiny_model_dir), "--num-prefill", "1", "--num-decode", "1"]
    up = start_up([*args, "--local-prefill-max-tokens", "0"])
    try:
        assert up.wait_up(), "\n".join(up.lines[-40:])
        pids = {m[1]: int(m[2]) for x in up.lines if (m := re.search(r"(\S+): pid (\d+), port", x))}
        expected = node_shares(None, [("prefill", 1), ("decode", 1)])
        for name, share in zip(("prefill-0", "decode-0"), expected):
            argv = Path(f"/proc/{pids[name]}/cmdline").read_bytes().decode().split("\0")
            assert argv[argv.index("--num-threads") + 1] == str(share.threads), name
            assert cpus_of(pids[name]) == (share.cpus or cpus_of(os.getpid())), name
        if len(os.sched_getaffinity(0)) >= 2:  # enough cores: each node on its own
            assert not cpus_of(pids["prefill-0"]) & cpus_of(pids["decode-0"])
        assert cpus_of(pids["router"]) == cpus_of(os.getpid())  # the router is not pinned
        assert any("threads per node: prefill" in x for x in up.lines)
        up.proc.send_signal(signal.SIGINT)
        assert up.proc.wait(60) == 0
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
            up.proc.wait(10)
