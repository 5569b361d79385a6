"""Flags and the process lifecycle shared by `pdserve prefill` and `pdserve decode`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
from typing import TYPE_CHECKING, Callable

from pdserve.cachestore.transport import Transport
from pdserve.commands.config_flags import config_flag
from pdserve.commands.device_args import add_device_args, add_enforce_eager_arg, add_tensor_parallel_arg, device_options
from pdserve.commands.discovery_args import add_discovery_args
from pdserve.commands.memory_args import add_kv_memory_args
from pdserve.commands.model_args import add_model_args
from pdserve.commands.serving_args import add_scheduler_args, add_served_name_args
from pdserve.engine.config import EngineConfig, Preemption
from pdserve.node_runtime.discovery import DiscoveryConfig, Role
from pdserve.node_runtime.node_config import (
    ROLE_ENGINE_DEFAULTS,
    ROLE_PORTS,
    NodeConfig,
    NodeOptions,
    TransferOptions,
    role_defaults,
)
from pdserve.node_runtime.tls_options import ClusterTLSOptions

if TYPE_CHECKING:  # the CLI imports no node code until a node runs
    from pdserve.node_runtime.node import Node


def add_kv_reuse_arg(p: argparse.ArgumentParser) -> None:
    """--kv-reuse, for a node or for every node of `up`. Unset, nothing is passed on and the node
    takes NodeOptions' default."""
    config_flag(p, NodeOptions, "kv_reuse")


def add_decode_kv_args(p: argparse.ArgumentParser) -> None:
    """--local-prefill-max-tokens and --kv-pull-min-blocks, for a decode node or every decode node of `up`."""
    config_flag(p, NodeOptions, "local_prefill_max_tokens")
    config_flag(p, NodeOptions, "kv_pull_min_blocks")


CLI_TRANSPORTS = (Transport.AUTO.value, Transport.TCP.value, Transport.RDMA.value)
"""--transport choices; `local` (both ends in one process) is for tests through the Python API."""


def add_node_args(p: argparse.ArgumentParser, role: str) -> None:
    """Flags of NodeConfig, one per field (EngineConfig's are named after its fields, `--model` for
    model_dir); every default is None so that the dataclass default applies (see node_config)."""
    add_model_args(p)
    add_served_name_args(p, NodeOptions)  # the model_name label of the node's metrics
    add_device_args(p)
    add_engine_args(p)
    config_flag(p, NodeOptions, "host")
    config_flag(p, NodeOptions, "port", stated_default=ROLE_PORTS[role])
    config_flag(p, NodeOptions, "metrics_port")
    config_flag(p, TransferOptions, "transport", choices=CLI_TRANSPORTS)
    config_flag(p, NodeOptions, "cluster_secret")
    config_flag(p, NodeOptions, "drain_timeout")
    config_flag(p, TransferOptions, "kv_timeout")
    config_flag(p, TransferOptions, "peer_timeout")
    config_flag(p, NodeOptions, "log_level")
    config_flag(p, NodeOptions, "advertise_host")
    add_kv_reuse_arg(p)
    for name in ("rdma_device", "rdma_port", "rdma_gid_index", "rdma_qps"):
        config_flag(p, TransferOptions, name)
    add_cluster_tls_args(p)
    add_discovery_args(p)


def add_cluster_tls_args(p: argparse.ArgumentParser) -> None:
    """Mutual TLS on the cluster's gRPC and CacheStore links (node_runtime.cluster_tls): all three or none."""
    for field in dataclasses.fields(ClusterTLSOptions):
        config_flag(p, ClusterTLSOptions, field.name)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The EngineConfig fields not covered by add_model_args/add_device_args (layer_range is for
    pipeline stages, not nodes)."""
    config_flag(p, EngineConfig, "num_kv_blocks")
    add_kv_memory_args(p)  # with --max-model-len, which the pool's fit check reads
    config_flag(p, EngineConfig, "block_size")
    add_scheduler_args(p)
    config_flag(p, EngineConfig, "enable_prefix_caching", action=argparse.BooleanOptionalAction)
    config_flag(
        p,
        EngineConfig,
        "preemption",
        choices=tuple(m.value for m in Preemption),
        stated_default=role_defaults("preemption"),
    )
    config_flag(p, EngineConfig, "num_threads")
    add_tensor_parallel_arg(p)
    add_enforce_eager_arg(p)


def node_config(args: argparse.Namespace, role: str) -> NodeConfig:
    """The one NodeConfig of a `pdserve prefill|decode` process, from its parsed flags (which
    configargparse already merged with PDSERVE_* and --config). A bad value exits 2 with the reason."""
    from pdserve.engine.builtin import default_model_dir
    from pdserve.node_runtime.config import flag_values

    try:
        engine = {
            **ROLE_ENGINE_DEFAULTS[role],
            **flag_values(args, EngineConfig, model_dir="model"),
            **device_options(args),
        }
        engine.setdefault("model_dir", default_model_dir())
        if role == Role.DECODE and engine["preemption"] != Preemption.NEVER:
            raise ValueError(
                f"a decode node needs --preemption never (it must never drop a request's KV), "
                f"got {engine['preemption']!r}"
            )
        node = {"port": ROLE_PORTS[role], **flag_values(args, NodeOptions)}
        node["advertise_host"] = advertise_host(args.advertise_host, node.get("host", NodeOptions.host))
        return NodeConfig(
            engine=EngineConfig(**engine),
            node=NodeOptions(**node),
            transfer=TransferOptions(**flag_values(args, TransferOptions)),
            discovery=DiscoveryConfig(**flag_values(args, DiscoveryConfig)),
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def advertise_host(requested: str | None, host: str) -> str:
    """The address peers should dial: --advertise-host, $POD_IP (Kubernetes downward API), --host,
    or this machine's hostname when --host is a wildcard."""
    import socket

    from pdserve.node_runtime.config import process_env

    if requested or process_env().pod_ip:
        return requested or process_env().pod_ip
    return socket.gethostname() if host in ("0.0.0.0", "::") else host


def serve(role: str, config: NodeConfig, make_node: Callable[[NodeConfig], Node]) -> int:
    """Build the node, start it, register it with discovery, print READY, run until SIGTERM/SIGINT,
    then deregister, drain and exit 0; if the engine thread dies, deregister and exit 1 at once."""
    config.transfer.export_env()
    from pdserve.node_runtime.memory_bounds import bound_shape_caches

    bound_shape_caches()  # before the engine's first kernel
    try:
        node = make_node(config)
    except ValueError as e:  # found at start (the KV pool cannot hold --max-model-len, a bad checkpoint)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(
        level=config.node.log_level.upper(), format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"
    )

    async def main() -> int:
        from pdserve.node_runtime.discovery import DiscoveryAuthError, DiscoveryError, Member, discovery_from_config

        address = await node.start()
        host = config.node.advertise_host or config.node.host
        meta = {"node_id": node.rt.node_id, "metrics_port": str(config.node.metrics_port), **node.discovery_meta()}
        member = Member(role, host, int(address.rsplit(":", 1)[1]), meta)
        try:
            discovery = discovery_from_config(config.discovery)
            await discovery.register(member)  # a no-op for static and k8s (the platform lists the pods)
        except (DiscoveryError, ValueError) as e:
            # Never READY: say why in one line (e.g. Nacos rejected the credentials). Rejected
            # credentials are a configuration error (2, as for a bad flag); anything else (registry
            # down) is 1, which a supervisor retries.
            print(f"error: {e}", file=sys.stderr, flush=True)
            await node.stop(drain=False)
            return 2 if isinstance(e, (DiscoveryAuthError, ValueError)) else 1
        print(f"READY {role} {address}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await asyncio.wait(
            [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(node.rt.failed.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )
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
