"""Flags and the process lifecycle shared by `pdserve prefill` and `pdserve decode`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import TYPE_CHECKING

from pdserve.commands.device_args import add_device_args, device_options
from pdserve.commands.generate import add_model_args

if TYPE_CHECKING:  # the CLI imports no node code until a node runs
    from pdserve.runtime.node import Node

TRANSPORTS = ("auto", "tcp", "rdma", "local")


def add_node_args(p: argparse.ArgumentParser, default_port: int) -> None:
    add_model_args(p)
    add_device_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    p.add_argument("--port", type=int, default=default_port, help="gRPC port (0: pick a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--transport", default=None, choices=TRANSPORTS,
                   help="CacheStore transport for KV (auto: RDMA if a device exists, else tcp; "
                        "default: $PDSERVE_TRANSPORT, else tcp)")
    p.add_argument("--cluster-secret", default=None, help="shared secret (default: $PDSERVE_CLUSTER_SECRET)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads for this process")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    p.add_argument("--kv-timeout", type=float, default=60.0, help="seconds a KV transfer may take")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--advertise-host", default=None,
                   help="host others use to reach this node (default: $POD_IP, else --host, or the hostname "
                        "if --host is a wildcard)")
    add_rdma_args(p)
    from pdserve.discovery import add_discovery_args
    add_discovery_args(p)


RDMA_FLAGS = {
    "rdma_device": ("PDSERVE_RDMA_DEVICE", "RDMA device (NIC) name, e.g. mlx5_0 (default: the first device)"),
    "rdma_port": ("PDSERVE_RDMA_PORT", "RDMA port number on the device (default 1)"),
    "rdma_gid_index": ("PDSERVE_RDMA_GID_INDEX", "GID index for RoCE (default 0)"),
    "rdma_qps": ("PDSERVE_RDMA_QPS", "RC queue pairs per receiver, used round robin (default 2)"),
}
"""--transport rdma settings: flag -> (the environment variable it sets for this process's CacheStore, help)."""


def add_rdma_args(p: argparse.ArgumentParser) -> None:
    for dest, (env, text) in RDMA_FLAGS.items():
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, default=None,
                       type=str if dest == "rdma_device" else int, help=f"{text}; default: ${env}")


def apply_rdma_args(args: argparse.Namespace) -> None:
    """Give the flags precedence over $PDSERVE_RDMA_* (which CacheStore reads when it sets up RDMA);
    exits 2 on a negative or zero number where one is needed."""
    import os
    for dest, (env, _) in RDMA_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        least = 0 if dest == "rdma_gid_index" else 1
        if dest != "rdma_device" and value < least:
            raise SystemExit(f"error: --{dest.replace('_', '-')} must be >= {least}, got {value}")
        os.environ[env] = str(value)


def engine_config(args: argparse.Namespace, **overrides):
    """EngineConfig from the node flags; a bad --device/--attention-backend exits 2 with the reason."""
    from engine.builtin import default_model_dir
    from engine.config import EngineConfig
    try:
        device = device_options(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return EngineConfig(**device, model_dir=args.model or default_model_dir(), dtype=args.dtype,
                        num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        num_threads=args.num_threads, **overrides)


def node_options(args: argparse.Namespace):
    from pdserve.auth import resolve_secret
    from pdserve.runtime.node import NodeOptions
    import os
    apply_rdma_args(args)
    transport = args.transport or os.environ.get("PDSERVE_TRANSPORT") or "tcp"
    if transport not in TRANSPORTS:
        raise SystemExit(f"error: PDSERVE_TRANSPORT must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    return NodeOptions(host=args.host, port=args.port, metrics_port=args.metrics_port,
                       cluster_secret=resolve_secret(args.cluster_secret), transport=transport,
                       drain_timeout=args.drain_timeout, kv_timeout=args.kv_timeout)


def advertise_host(args: argparse.Namespace) -> str:
    """The address peers should dial: --advertise-host, $POD_IP (Kubernetes downward API), --host,
    or this machine's hostname when --host is a wildcard."""
    import os
    import socket
    if args.advertise_host or os.environ.get("POD_IP"):
        return args.advertise_host or os.environ["POD_IP"]
    return socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host


def serve(node: Node, role: str, args: argparse.Namespace) -> int:
    """Start `node`, register it with discovery, print READY, run until SIGTERM/SIGINT, then
    deregister, drain and exit 0; if the engine thread dies, deregister and exit 1 at once."""
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")

    async def main() -> None:
        from pdserve.discovery import Member, discovery_from_args
        address = await node.start()
        host = advertise_host(args)
        meta = {"node_id": node.rt.node_id, "metrics_port": str(args.metrics_port), **node.discovery_meta()}
        member = Member(role, host, int(address.rsplit(":", 1)[1]), meta)
        discovery = discovery_from_args(args)
        await discovery.register(member)  # a no-op for static and k8s (the platform lists the pods)
        print(f"READY {role} {address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await asyncio.wait([asyncio.ensure_future(stop.wait()), asyncio.ensure_future(node.rt.failed.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        failed = node.rt.failed.is_set()
        logging.getLogger("pdserve").info("%s %s", "stopping failed" if failed else "draining", role)
        await discovery.deregister(member)
        await discovery.stop()
        await node.stop(drain=not failed)  # a dead engine has nothing to drain
        return 1 if failed else 0

    try:
        import uvloop
        return uvloop.run(main())
    except ImportError:
        return asyncio.run(main())
