"""`pdserve up`: a whole cluster on 127.0.0.1 — prefill and decode nodes plus the router."""

from __future__ import annotations

import argparse
import atexit
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from pdserve.commands.config_flags import config_flag, plain_flag
from pdserve.commands.core_split import add_num_threads_arg, describe, node_shares, sharing_note
from pdserve.commands.model_args import add_model_args
from pdserve.commands.node_common import CLI_TRANSPORTS, add_decode_kv_args, add_kv_reuse_arg
from pdserve.commands.router import (
    add_api_key_args,
    add_key_limit_args,
    add_planner_args,
    add_routing_args,
    api_keys,
)
from pdserve.commands.up_scaler import RoleScaler, make_scaler, planner_slots
from pdserve.commands.serving_args import (
    NODE_FLAGS,
    ROUTER_FLAGS,
    add_frontend_args,
    add_scheduler_args,
    add_served_name_args,
    child_flags,
    declared_dests,
)
from pdserve.node_runtime.config import API_KEY_ENV, API_KEYS_ENV, CLUSTER_SECRET_ENV
from pdserve.node_runtime.discovery import Role
from pdserve.node_runtime.supervisor import RestartPolicy, Supervised, Supervisor

READY_TIMEOUT = 180.0


def register(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.node_runtime.node_config import TransferOptions
    from pdserve.router.config import RouterConfig

    p = subparsers.add_parser("up", help="start router + prefill + decode nodes on 127.0.0.1")
    add_model_args(p)
    from pdserve.commands.device_args import add_device_args, add_enforce_eager_arg, add_tensor_parallel_arg

    add_device_args(p)  # every node of the cluster shares the device (one GPU: they share it)
    from pdserve.commands.memory_args import add_kv_memory_args

    add_kv_memory_args(p)  # per node: on one GPU, N nodes at 0.9 each cannot all start; give each 0.9/N
    add_served_name_args(p)
    add_frontend_args(p)  # the router's
    add_scheduler_args(p)  # each node's
    plain_flag(
        p, "--num-prefill", type=int, default=1, help="prefill nodes (0: decode-only nodes prefill every prompt)"
    )
    plain_flag(p, "--num-decode", type=int, default=2, help="decode nodes")
    add_kv_reuse_arg(p)
    add_decode_kv_args(p)
    config_flag(p, TransferOptions, "transport", choices=CLI_TRANSPORTS, keep_default=True)
    config_flag(p, RouterConfig, "port", keep_default=True)
    plain_flag(
        p,
        "--host",
        default=RouterConfig.host,
        help="address the router binds (0.0.0.0 in a container whose port is published); "
        "the nodes always stay on 127.0.0.1",
    )
    plain_flag(
        p, "--base-port", type=int, default=0, help="first gRPC port for the nodes (0: let each pick a free port)"
    )
    plain_flag(
        p,
        "--metrics-base-port",
        type=int,
        default=0,
        help="first Prometheus /metrics port for the nodes, one each in order prefill-0.., decode-0.. "
        "(0: nodes serve no metrics; the router always serves /metrics on --port)",
    )
    add_api_key_args(p)
    add_num_threads_arg(p)
    add_tensor_parallel_arg(p)
    add_enforce_eager_arg(p)
    for role in (Role.PREFILL, Role.DECODE):
        p.add_argument(
            f"--{role}-tensor-parallel-size",
            type=int,
            default=None,
            help=f"tensor-parallel ranks of each {role} node (default: --tensor-parallel-size, "
            f"else {EngineConfig.tensor_parallel_size})",
        )
    plain_flag(
        p,
        "--max-restarts",
        type=int,
        default=5,
        help="a process restarted this many times within --restart-window seconds stops the cluster",
    )
    plain_flag(p, "--restart-window", type=float, default=60.0, help="seconds that --max-restarts counts over")
    p.add_argument(
        "--cluster-tls",
        action="store_true",
        help="mutual TLS between router and nodes and on the KV links, with a throwaway CA made for this run "
        "(needs `cryptography`)",
    )
    add_routing_args(p)
    add_planner_args(p)  # the router decides; `up` starts and stops nodes to match (commands/up_scaler.py)
    p.set_defaults(func=run)


def _wait_health(url: str, deadline: float, members: list[Supervised]) -> None:
    while time.monotonic() < deadline:
        for m in members:
            assert m.child is not None  # started before the wait
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


def reach_url(args: argparse.Namespace) -> str:
    """The router's base URL from this machine: a wildcard bind is reached (and shown) through
    loopback, a specific address through itself."""
    reach = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return f"http://{reach}:{args.port}"


def _throwaway_tls_args(directory: Path) -> list[str]:
    """A CA and certificate for this run only (the key never leaves `directory`, removed at exit)."""
    from pdserve.node_runtime.cluster_tls import make_throwaway

    cert, key, ca = make_throwaway(directory)
    return ["--cluster-tls-cert", str(cert), "--cluster-tls-key", str(key), "--cluster-tls-ca", str(ca)]


def run(args: argparse.Namespace) -> int:
    from pdserve.commands.device_args import device_flags
    from pdserve.commands.local_master import LocalMaster, wants_local_master
    from pdserve.commands.memory_args import kv_memory_flags
    from pdserve.engine.builtin import default_model_dir
    from pdserve.node_runtime.config import flag_values
    from pdserve.router.key_limits import KeyLimits
    from pdserve.router.slo_planner import PlannerConfig

    if args.num_prefill < 0 or args.num_decode < 1:
        print("error: --num-prefill must be >= 0 and --num-decode >= 1", file=sys.stderr)
        return 2
    try:  # what the router would refuse, refused before any node starts
        KeyLimits(**flag_values(args, KeyLimits)).check_keys(api_keys(args))
        planner = PlannerConfig(**flag_values(args, PlannerConfig))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    num_slots = planner_slots(args, planner, args.num_prefill + args.num_decode)
    if num_slots is None:
        return 2
    master = None
    if wants_local_master(args.kv_store):  # a Mooncake master for this cluster, stopped after its nodes
        try:
            master = LocalMaster(args.kv_store)
            master.start()
        except (ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        atexit.register(master.stop)  # also if anything below fails before the cluster's own cleanup
        args.kv_store = master.url
        print(f"[up] Mooncake master for this cluster: {master.url}", flush=True)
    model = args.model or str(default_model_dir())  # build the built-in model once, before the children start
    secret = secrets.token_hex(16)
    env = {**os.environ, CLUSTER_SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}
    base = [sys.executable, "-m", "pdserve.cli"]
    node_args = (
        ["--host", "127.0.0.1", "--model", model, "--transport", args.transport]
        + (["--dtype", args.dtype] if args.dtype else [])
        + device_flags(args)
        + kv_memory_flags(args)
        + child_flags(args, NODE_FLAGS)
        + (["--kv-reuse", "on" if args.kv_reuse else "off"] if args.kv_reuse is not None else [])
    )
    decode_args = [
        arg
        for flag, value in (
            ("--local-prefill-max-tokens", args.local_prefill_max_tokens),
            ("--kv-pull-min-blocks", args.kv_pull_min_blocks),
        )
        if value is not None
        for arg in (flag, str(value))
    ]
    tls_dir = tempfile.mkdtemp(prefix="pdserve-tls-") if args.cluster_tls else None
    tls_args = _throwaway_tls_args(Path(tls_dir)) if tls_dir else []
    node_args += tls_args
    stopping = threading.Event()
    policy = lambda: RestartPolicy(args.max_restarts, args.restart_window)  # noqa: E731

    roles = ["prefill"] * args.num_prefill + ["decode"] * args.num_decode
    # spare slots hold cores for the nodes the planner may start (weighed as decode nodes)
    roles += ["decode"] * (num_slots - len(roles))
    tps = [getattr(args, f"{role}_tensor_parallel_size") or args.tensor_parallel_size for role in roles]
    shares = node_shares(args.num_threads, [(role, tp or 1) for role, tp in zip(roles, tps)])
    spare = num_slots - args.num_prefill - args.num_decode
    print(f"[up] threads per node: {describe(roles, shares)}" + (f" ({spare} spare)" if spare else ""), flush=True)
    note = sharing_note(shares, len(os.sched_getaffinity(0))) if args.num_threads is None else None
    if note and (args.device or "cpu") == "cpu":
        print(f"[up] note: {note}", flush=True)

    def node(role: str, i: int, port: int) -> Supervised:
        return node_at(role, i if role == Role.PREFILL else args.num_prefill + i, f"{role}-{i}", port)

    def node_at(role: str, index: int, name: str, port: int) -> Supervised:
        """A node of `role` on slot `index`'s cores (TP is one size for both roles when slots switch)."""
        metrics = ["--metrics-port", str(args.metrics_base_port + index)] if args.metrics_base_port else []
        own = decode_args if role == Role.DECODE else []
        own = own + (["--tensor-parallel-size", str(tps[index])] if tps[index] else [])
        own = own + ["--num-threads", str(shares[index].threads)]
        return Supervised(
            name,
            lambda p: base + [role, "--port", str(p)] + node_args + own + metrics,
            port,
            env,
            policy(),
            cpus=shares[index].cpus,
        )

    def shutdown(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    first = args.base_port
    scaler: RoleScaler | None = None
    prefills = [node("prefill", i, first + i if first else 0) for i in range(args.num_prefill)]
    decodes = [node("decode", i, first + args.num_prefill + i if first else 0) for i in range(args.num_decode)]
    supervisor = Supervisor(prefills + decodes, log=lambda msg: print(f"[up] {msg}", flush=True))
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        for m in prefills + decodes:
            m.start()
        p_addrs = [m.wait_ready(deadline) for m in prefills]
        d_addrs = [m.wait_ready(deadline) for m in decodes]
        if planner.enabled:  # the router finds the nodes in a file that follows the planner's changes
            serving = [("prefill", m) for m in prefills] + [("decode", m) for m in decodes]
            scaler = make_scaler(args, planner, num_slots, serving, node_at, supervisor, reach_url(args))
            members = ["--discovery", "file", "--members-file", scaler.members_file]
            if planner.planner_max_nodes is None:  # the budget is every slot, spare ones included
                members += ["--planner-max-nodes", str(num_slots)]
            if planner.planner_min_nodes is None:  # the cores of the nodes asked for are held anyway
                members += ["--planner-min-nodes", str(min(len(serving), planner.planner_max_nodes or num_slots))]
        else:
            members = ["--prefill", ",".join(p_addrs), "--decode", ",".join(d_addrs)]
        router_args = [
            "--host",
            args.host,
            "--model",
            model,
            *members,
            *tls_args,
            *child_flags(args, ROUTER_FLAGS),  # --max-model-len: the router learns it from the nodes
        ]
        if args.model is None and not args.served_model_name:
            router_args += ["--served-model-name", "pdserve-tiny"]
        router_args += child_flags(
            args,
            declared_dests(add_routing_args) + declared_dests(add_key_limit_args) + declared_dests(add_planner_args),
        )
        # keys travel in the router's environment, never on its command line (where `ps` shows them)
        router_env = {**env, API_KEYS_ENV: ",".join(api_keys(args)), API_KEY_ENV: ""}
        router = Supervised(
            "router", lambda p: base + ["router", "--port", str(p)] + router_args, args.port, router_env, policy()
        )
        supervisor.members.append(router)
        router.start()
        _wait_health(f"{reach_url(args)}/health", deadline, supervisor.members)
        default_name = "pdserve-tiny" if args.model is None else os.path.basename(model.rstrip("/"))
        name = ", ".join(args.served_model_name or [default_name])
        print(
            f"pdserve is up: {reach_url(args)}/v1  (model: {name}; "
            f"{args.num_prefill} prefill, {args.num_decode} decode, transport {args.transport})",
            flush=True,
        )
        for k, m in enumerate(supervisor.members):
            metrics = (
                f", metrics :{args.metrics_base_port + k}/metrics" if args.metrics_base_port and m is not router else ""
            )
            print(f"  {m.name}: pid {m.child.popen.pid if m.child else '-'}, port {m.port}{metrics}", flush=True)
        print("Ctrl-C stops the cluster; a node that dies is restarted on its port.", flush=True)
        while not stopping.is_set():
            reason = supervisor.poll()
            if reason:
                print(f"error: {reason}\nstopping the cluster", file=sys.stderr, flush=True)
                return 1
            if scaler is not None:
                scaler.poll(time.monotonic())
            stopping.wait(0.25)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if scaler is not None:
            scaler.stop()  # nodes starting or draining, which the supervisor does not hold
        supervisor.stop()
        if master is not None:
            master.stop()
        if tls_dir:
            shutil.rmtree(tls_dir, ignore_errors=True)
        print(f"pdserve stopped ({supervisor.num_restarts} restarts).", flush=True)
