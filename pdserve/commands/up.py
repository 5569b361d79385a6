"""`pdserve up`: a whole cluster on 127.0.0.1 — prefill and decode nodes plus the router."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from pdserve.commands.generate import add_model_args

READY_TIMEOUT = 180.0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="start router + prefill + decode nodes on 127.0.0.1")
    add_model_args(p)
    from pdserve.commands.device_args import add_device_args
    add_device_args(p)  # every node of the cluster shares the device (one GPU: they share it)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=2)
    p.add_argument("--transport", default="tcp", choices=["auto", "tcp", "rdma"])
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument("--base-port", type=int, default=0,
                   help="first gRPC port for the nodes (0: let each pick a free port)")
    p.add_argument("--api-key", action="append", default=None, help="require this Bearer key (repeatable)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per node process")
    p.set_defaults(func=run)


class Child:
    """A child process whose output is echoed with a prefix and scanned for its READY line."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      start_new_session=True)
        self.address = ""
        self.ready = threading.Event()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if line.startswith("READY "):
                self.address = line.split()[-1]
                self.ready.set()
            elif "ERROR" in line or "Traceback" in line:
                print(f"[{self.name}] {line}", flush=True)
        self.ready.set()

    def wait_ready(self, deadline: float) -> str:
        self.ready.wait(max(0.0, deadline - time.monotonic()))
        if not self.address:
            raise RuntimeError(f"{self.name} failed to start:\n" + "\n".join(self.lines[-30:]))
        return self.address

    def stop(self, grace: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)


def _wait_health(url: str, deadline: float, children: list[Child]) -> None:
    while time.monotonic() < deadline:
        for c in children:
            if c.popen.poll() is not None:
                raise RuntimeError(f"{c.name} exited with {c.popen.returncode}:\n" + "\n".join(c.lines[-30:]))
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"router did not become healthy at {url}")


def run(args: argparse.Namespace) -> int:
    from engine.builtin import default_model_dir
    from pdserve.commands.device_args import device_flags
    model = args.model or str(default_model_dir())  # build the built-in model once, before the children start
    secret = secrets.token_hex(16)
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": secret, "PYTHONUNBUFFERED": "1"}
    base = [sys.executable, "-m", "pdserve.cli"]
    node_args = ["--host", "127.0.0.1", "--model", model, "--dtype", args.dtype, "--transport", args.transport,
                 "--num-threads", str(args.num_threads)] + device_flags(args)
    children: list[Child] = []
    stopping = threading.Event()

    def port(i: int) -> str:
        return str(args.base_port + i) if args.base_port else "0"

    def shutdown(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        prefills = [Child(f"prefill-{i}", base + ["prefill", "--port", port(i)] + node_args, env)
                    for i in range(args.num_prefill)]
        decodes = [Child(f"decode-{i}", base + ["decode", "--port", port(args.num_prefill + i)] + node_args, env)
                   for i in range(args.num_decode)]
        children += prefills + decodes
        p_addrs = [c.wait_ready(deadline) for c in prefills]
        d_addrs = [c.wait_ready(deadline) for c in decodes]
        router_cmd = base + ["router", "--host", "127.0.0.1", "--port", str(args.port), "--model", model,
                             "--prefill", ",".join(p_addrs), "--decode", ",".join(d_addrs)]
        if args.model is None:
            router_cmd += ["--served-model-name", "pdserve-tiny"]
        for key in args.api_key or []:
            router_cmd += ["--api-key", key]
        children.append(Child("router", router_cmd, env))
        _wait_health(f"http://127.0.0.1:{args.port}/health", deadline, children)
        name = "pdserve-tiny" if args.model is None else os.path.basename(model.rstrip("/"))
        print(f"pdserve is up: http://127.0.0.1:{args.port}/v1  (model: {name}; "
              f"{args.num_prefill} prefill, {args.num_decode} decode, transport {args.transport})", flush=True)
        print("Ctrl-C stops the cluster.", flush=True)
        while not stopping.is_set():
            dead = [c for c in children if c.popen.poll() is not None]
            if dead:
                print(f"{dead[0].name} exited with {dead[0].popen.returncode}; stopping the cluster", flush=True)
                return 1
            stopping.wait(0.5)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for c in reversed(children):
            c.stop()
        print("pdserve stopped.", flush=True)
