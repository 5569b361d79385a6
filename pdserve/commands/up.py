"""`pdserve up`: a whole cluster on 127.0.0.1 — prefill and decode nodes plus the router."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
import time
import urllib.request

from pdserve.commands.generate import add_model_args
from pdserve.commands.node_common import CLI_TRANSPORTS
from pdserve.commands.router import add_api_key_args, add_routing_args, api_keys
from pdserve.config import API_KEY_ENV, API_KEYS_ENV, CLUSTER_SECRET_ENV
from pdserve.runtime.supervisor import RestartPolicy, Supervised, Supervisor

READY_TIMEOUT = 180.0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="start router + prefill + decode nodes on 127.0.0.1")
    add_model_args(p)
    from pdserve.commands.device_args import add_device_args

    add_device_args(p)  # every node of the cluster shares the device (one GPU: they share it)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=2)
    p.add_argument("--transport", default="tcp", choices=CLI_TRANSPORTS)
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the router binds (0.0.0.0 in a container whose port is published); "
        "the nodes always stay on 127.0.0.1",
    )
    p.add_argument(
        "--base-port", type=int, default=0, help="first gRPC port for the nodes (0: let each pick a free port)"
    )
    p.add_argument(
        "--metrics-base-port",
        type=int,
        default=0,
        help="first Prometheus /metrics port for the nodes, one each in order prefill-0.., decode-0.. "
        "(0: nodes serve no metrics; the router always serves /metrics on --port)",
    )
    add_api_key_args(p)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per node process")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="a process restarted this many times within --restart-window seconds stops the cluster",
    )
    p.add_argument("--restart-window", type=float, default=60.0)
    add_routing_args(p)
    p.set_defaults(func=run)


def _wait_health(url: str, deadline: float, members: list[Supervised]) -> None:
    while time.monotonic() < deadline:
        for m in members:
            if m.child.exited:
                raise RuntimeError(f"{m.name} exited with {m.child.popen.returncode}:\n{m.child.tail()}")
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
    env = {**os.environ, CLUSTER_SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}
    base = [sys.executable, "-m", "pdserve.cli"]
    node_args = (
        ["--host", "127.0.0.1", "--model", model, "--transport", args.transport, "--num-threads", str(args.num_threads)]
        + (["--dtype", args.dtype] if args.dtype else [])
        + device_flags(args)
    )
    stopping = threading.Event()
    policy = lambda: RestartPolicy(args.max_restarts, args.restart_window)  # noqa: E731

    def node(role: str, i: int, port: int) -> Supervised:
        index = i if role == "prefill" else args.num_prefill + i
        metrics = ["--metrics-port", str(args.metrics_base_port + index)] if args.metrics_base_port else []
        return Supervised(
            f"{role}-{i}", lambda p: base + [role, "--port", str(p)] + node_args + metrics, port, env, policy()
        )

    def shutdown(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    first = args.base_port
    prefills = [node("prefill", i, first + i if first else 0) for i in range(args.num_prefill)]
    decodes = [node("decode", i, first + args.num_prefill + i if first else 0) for i in range(args.num_decode)]
    supervisor = Supervisor(prefills + decodes, log=lambda msg: print(f"[up] {msg}", flush=True))
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        for m in prefills + decodes:
            m.start()
        p_addrs = [m.wait_ready(deadline) for m in prefills]
        d_addrs = [m.wait_ready(deadline) for m in decodes]
        router_args = [
            "--host",
            args.host,
            "--model",
            model,
            "--prefill",
            ",".join(p_addrs),
            "--decode",
            ",".join(d_addrs),
        ]
        if args.model is None:
            router_args += ["--served-model-name", "pdserve-tiny"]
        if args.routing:
            router_args += ["--routing", args.routing]
        # keys travel in the router's environment, never on its command line (where `ps` shows them)
        router_env = {**env, API_KEYS_ENV: ",".join(api_keys(args)), API_KEY_ENV: ""}
        router = Supervised(
            "router", lambda p: base + ["router", "--port", str(p)] + router_args, args.port, router_env, policy()
        )
        supervisor.members.append(router)
        router.start()
        # a wildcard bind is reached (and shown) through loopback; a specific address through itself
        reach = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        _wait_health(f"http://{reach}:{args.port}/health", deadline, supervisor.members)
        name = "pdserve-tiny" if args.model is None else os.path.basename(model.rstrip("/"))
        print(
            f"pdserve is up: http://{reach}:{args.port}/v1  (model: {name}; "
            f"{args.num_prefill} prefill, {args.num_decode} decode, transport {args.transport})",
            flush=True,
        )
        for k, m in enumerate(supervisor.members):
            metrics = (
                f", metrics :{args.metrics_base_port + k}/metrics" if args.metrics_base_port and m is not router else ""
            )
            print(f"  {m.name}: pid {m.child.popen.pid}, port {m.port}{metrics}", flush=True)
        print("Ctrl-C stops the cluster; a node that dies is restarted on its port.", flush=True)
        while not stopping.is_set():
            reason = supervisor.poll()
            if reason:
                print(f"error: {reason}\nstopping the cluster", file=sys.stderr, flush=True)
                return 1
            stopping.wait(0.25)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        supervisor.stop()
        print(f"pdserve stopped ({supervisor.num_restarts} restarts).", flush=True)
