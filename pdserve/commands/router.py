"""`pdserve router`: the OpenAI-compatible HTTP front end."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from pdserve.commands.config_flags import config_flag
from pdserve.commands.memory_args import add_max_model_len_arg
from pdserve.commands.model_args import add_model_args
from pdserve.commands.serving_args import add_frontend_args, add_served_name_args, load_frontend
from pdserve.commands.node_common import add_cluster_tls_args
from pdserve.node_runtime.config import API_KEYS_ENV

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig

__all__ = [
    "API_KEYS_ENV",
    "add_api_key_args",
    "add_key_limit_args",
    "add_routing_args",
    "api_keys",
    "register",
    "router_config",
    "run",
]


def add_api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="accepted Bearer key (repeatable; visible in `ps`: prefer --api-key-file or the env)",
    )
    p.add_argument(
        "--api-key-file",
        action="append",
        default=None,
        help="file with accepted Bearer keys, one per line (repeatable)",
    )
    add_key_limit_args(p)


def add_key_limit_args(p: argparse.ArgumentParser) -> None:
    """The per-key limits (router/key_limits.py): `up` hands them to its router as flags."""
    from pdserve.router.key_limits import KeyLimits

    config_flag(p, KeyLimits, "api_key_max_in_flight")
    config_flag(p, KeyLimits, "api_key_rpm")


def api_keys(args: argparse.Namespace) -> list[str]:
    """Keys from --api-key, --api-key-file, $PDSERVE_API_KEY and $PDSERVE_API_KEYS (all of them); none = open."""
    keys = list(args.api_key or [])
    for path in args.api_key_file or []:
        try:
            with open(path, encoding="utf-8") as f:
                keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        except OSError as e:
            raise SystemExit(f"error: cannot read --api-key-file {path}: {e.strerror}") from None
    from pdserve.node_runtime.config import process_env

    keys += process_env().api_keys
    return [k.strip() for k in keys if k.strip()]


def register(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.router.config import ClusterOptions, RouterConfig
    from pdserve.router.deadlines import Deadlines

    from pdserve.commands.discovery_args import add_discovery_args

    p = subparsers.add_parser("router", help="run the OpenAI-compatible router")
    add_model_args(p, RouterConfig)
    add_discovery_args(p)
    config_flag(p, RouterConfig, "host")
    config_flag(p, RouterConfig, "port")
    add_served_name_args(p)
    add_frontend_args(p)
    add_max_model_len_arg(p, RouterConfig)
    add_api_key_args(p)
    config_flag(p, ClusterOptions, "cluster_secret")
    config_flag(p, RouterConfig, "ssl_certfile")
    config_flag(p, RouterConfig, "ssl_keyfile")
    config_flag(p, RouterConfig, "max_prompt_tokens")
    config_flag(p, RouterConfig, "graceful_timeout")
    config_flag(p, Deadlines, "token_timeout")
    config_flag(p, Deadlines, "itl_factor")
    config_flag(p, Deadlines, "first_token_timeout")
    config_flag(p, Deadlines, "health_timeout")
    config_flag(p, Deadlines, "hung_after")
    config_flag(p, Deadlines, "capacity_wait")
    add_connection_args(p)
    add_cluster_tls_args(p)
    add_routing_args(p)
    add_planner_args(p)
    config_flag(p, RouterConfig, "log_level")
    p.set_defaults(func=run)


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """Flags of pdserve.router.http_limits.ConnectionLimits and the SSE keep-alive interval."""
    from pdserve.router.config import RouterConfig
    from pdserve.router.http_limits import ConnectionLimits

    config_flag(p, ConnectionLimits, "header_timeout")
    config_flag(p, ConnectionLimits, "keepalive_timeout")
    config_flag(p, ConnectionLimits, "body_timeout")
    config_flag(p, ConnectionLimits, "max_connections")
    config_flag(p, RouterConfig, "sse_keepalive")


def add_routing_args(p: argparse.ArgumentParser) -> None:
    from pdserve.router.config import ClusterOptions
    from pdserve.router.deadlines import Deadlines
    from pdserve.router.kv_routing import ROUTING_MODES

    config_flag(p, ClusterOptions, "routing", choices=ROUTING_MODES)
    config_flag(p, ClusterOptions, "prefill_saturated_tokens")
    config_flag(p, ClusterOptions, "max_waiting_requests")
    config_flag(p, Deadlines, "max_prefill_backlog", type=float)


def add_planner_args(p: argparse.ArgumentParser) -> None:
    """The runtime SLO planner's flags (router/slo_planner.py): `up` hands them to its router."""
    from pdserve.router.slo_planner import PLANNERS, PlannerConfig

    config_flag(p, PlannerConfig, "planner", choices=PLANNERS)
    config_flag(p, PlannerConfig, "ttft_slo")
    config_flag(p, PlannerConfig, "tpot_slo")
    config_flag(p, PlannerConfig, "planner_interval")
    config_flag(p, PlannerConfig, "planner_window")
    config_flag(p, PlannerConfig, "planner_dwell")
    config_flag(p, PlannerConfig, "planner_max_nodes")
    config_flag(p, PlannerConfig, "planner_min_prefill", choices=(0, 1))
    config_flag(p, PlannerConfig, "planner_min_nodes")


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The one RouterConfig of a `pdserve router` process, from its parsed flags (which configargparse
    already merged with PDSERVE_* and --config); a bad value exits 2 with the reason."""
    from pdserve.engine.builtin import default_model_dir
    from pdserve.node_runtime.config import flag_values
    from pdserve.node_runtime.discovery import DiscoveryConfig
    from pdserve.router.config import ClusterOptions, RouterConfig
    from pdserve.router.deadlines import Deadlines
    from pdserve.router.http_limits import ConnectionLimits
    from pdserve.router.key_limits import KeyLimits
    from pdserve.router.slo_planner import PlannerConfig

    try:
        cluster = ClusterOptions(
            **flag_values(args, ClusterOptions, deadlines=None), deadlines=Deadlines(**flag_values(args, Deadlines))
        )
        top = flag_values(
            args,
            RouterConfig,
            model_dir="model",
            cluster=None,
            discovery=None,
            connections=None,
            key_limits=None,
            slo_planner=None,
        )
        top["served_model_name"] = tuple(top.get("served_model_name") or ())
        top.setdefault("model_dir", default_model_dir())
        return RouterConfig(
            **top,
            api_keys=tuple(api_keys(args)),
            key_limits=KeyLimits(**flag_values(args, KeyLimits)),
            cluster=cluster,
            connections=ConnectionLimits(**flag_values(args, ConnectionLimits)),
            discovery=DiscoveryConfig(**flag_values(args, DiscoveryConfig)),
            slo_planner=PlannerConfig(**flag_values(args, PlannerConfig)),
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def run(args: argparse.Namespace) -> int:
    import logging

    from prometheus_client import CollectorRegistry

    from pdserve.engine.model_config import ModelConfig
    from pdserve.node_runtime.discovery import DiscoveryError, discovery_from_config
    from pdserve.node_runtime.node_metrics import add_process_collectors, served_model_name
    from pdserve.router.app import create_app
    from pdserve.router.cluster import Cluster
    from pdserve.router.cluster_metrics import ClusterCollector
    from pdserve.router.kv_metrics import KvRoutingCollector
    from pdserve.router.prefill_offload import OffloadPolicy
    from pdserve.router.request_metrics import RequestMetrics
    from pdserve.router.serving import Server

    config = router_config(args)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    names = config.served_model_name or (served_model_name(config.model_dir),)
    name = names[0]
    tokenizer, defaults = load_frontend(config)
    if args.api_key:
        logging.getLogger("pdserve.router").warning(
            "--api-key puts the key on the command line, where `ps` shows it; use --api-key-file or $PDSERVE_API_KEY"
        )
    registry = add_process_collectors(CollectorRegistry())
    max_model_len = ModelConfig.from_dir(config.model_dir).max_position_embeddings
    try:  # rejected Nacos credentials end here in one line, not in the HTTP server's start-up traceback
        discovery = discovery_from_config(config.discovery)
        asyncio.run(discovery.check())
    except (DiscoveryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    cluster = Cluster(
        discovery,
        model_name=name,
        cluster_secret=config.cluster.cluster_secret,
        deadlines=config.cluster.deadlines,
        registry=registry,
        tls=config.cluster.tls(),
        routing=config.cluster.routing,
        offload=OffloadPolicy(config.cluster.prefill_saturated_tokens, tpot_slo=config.slo_planner.tpot_slo),
        max_waiting_requests=config.cluster.max_waiting_requests,
    )
    planner = None
    window = None
    if config.slo_planner.enabled:
        from pdserve.router.planner_loop import PlannerLoop
        from pdserve.router.request_window import RequestWindow

        window = RequestWindow(config.slo_planner.planner_window)
        planner = PlannerLoop(config.slo_planner, cluster, window, registry, name)
    server = Server(
        cluster,
        tokenizer,
        names,
        max_model_len,
        config.max_prompt_tokens,
        metrics=RequestMetrics(registry, name, max_model_len, window),
        keepalive_interval=config.sse_keepalive,
        generation_defaults=defaults,
        prompt_tokens_details=config.enable_prompt_tokens_details,
        max_model_len_cap=config.max_model_len,
    )
    ClusterCollector(cluster, name, registry)
    KvRoutingCollector(cluster, name, registry)
    app = create_app(
        server,
        api_keys=list(config.api_keys),
        registry=registry,
        body_timeout=config.connections.body_timeout,
        key_limits=config.key_limits,
    )

    @app.on_event("startup")
    async def _start() -> None:
        await cluster.start()
        if planner is not None:
            await planner.start()

    def _listening() -> None:
        scheme = "https" if config.ssl_certfile else "http"
        print(f"READY router {scheme}://{config.host}:{config.port}", flush=True)

    @app.on_event("shutdown")
    async def _stop() -> None:
        if planner is not None:
            await planner.stop()
        await cluster.stop()

    from pdserve.router.http_server import serve_http

    serve_http(
        app,
        config.host,
        config.port,
        config.connections,
        log_level=config.log_level,
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
        on_listening=_listening,
        graceful_timeout=config.graceful_timeout,
    )
    return 0
