"""`pdserve router`: the OpenAI-compatible HTTP front end."""

from __future__ import annotations

import argparse
import os

from pdserve.commands.generate import add_model_args

API_KEYS_ENV = "PDSERVE_API_KEYS"
"""Comma-separated Bearer keys (PDSERVE_API_KEY holds a single one)."""


def add_api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted Bearer key (repeatable; visible in `ps`: prefer --api-key-file or the env)")
    p.add_argument("--api-key-file", action="append", default=None,
                   help="file with accepted Bearer keys, one per line (repeatable)")


def api_keys(args: argparse.Namespace) -> list[str]:
    """Keys from --api-key, --api-key-file, $PDSERVE_API_KEY and $PDSERVE_API_KEYS (all of them); none = open."""
    keys = list(args.api_key or [])
    for path in args.api_key_file or []:
        try:
            with open(path, encoding="utf-8") as f:
                keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        except OSError as e:
            raise SystemExit(f"error: cannot read --api-key-file {path}: {e.strerror}") from None
    keys.append(os.environ.get("PDSERVE_API_KEY", ""))
    keys += os.environ.get(API_KEYS_ENV, "").split(",")
    return [k.strip() for k in keys if k.strip()]


def register(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.discovery import add_discovery_args
    p = subparsers.add_parser("router", help="run the OpenAI-compatible router")
    add_model_args(p)
    add_discovery_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: model dir name)")
    add_api_key_args(p)
    p.add_argument("--cluster-secret", default=None, help="shared node secret (default: $PDSERVE_CLUSTER_SECRET)")
    p.add_argument("--ssl-certfile", default=None)
    p.add_argument("--ssl-keyfile", default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="refuse longer prompts (400)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds open streams may finish after SIGTERM before they are cut (uvicorn)")
    p.add_argument("--token-timeout", type=float, default=2.0,
                   help="migrate a stream that gets no token for this long (raised to --itl-factor x the "
                        "observed inter-token latency on slow nodes)")
    p.add_argument("--itl-factor", type=float, default=20.0)
    p.add_argument("--first-token-timeout", type=float, default=120.0, help="wait this long for a first token")
    p.add_argument("--health-timeout", type=float, default=1.0,
                   help="a node that misses a health check by this long gets no new requests until it answers")
    p.add_argument("--capacity-wait", type=float, default=30.0,
                   help="a request waits this long for a usable node with room before a 503 (0: fail at once)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn
    from prometheus_client import CollectorRegistry

    from engine.builtin import default_model_dir
    from engine.model_config import ModelConfig
    from engine.tokenizer import Tokenizer
    from pdserve.discovery import discovery_from_args
    from pdserve.auth import resolve_secret
    from pdserve.runtime.node_metrics import add_process_collectors, served_model_name
    from router.app import create_app
    from router.cluster import Cluster
    from router.cluster_metrics import ClusterCollector
    from router.deadlines import Deadlines
    from router.request_metrics import RequestMetrics
    from router.serving import Server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    model_dir = args.model or default_model_dir()
    name = args.served_model_name or served_model_name(model_dir)
    keys = api_keys(args)
    if args.api_key:
        logging.getLogger("pdserve.router").warning(
            "--api-key puts the key on the command line, where `ps` shows it; use --api-key-file or $PDSERVE_API_KEY")
    registry = add_process_collectors(CollectorRegistry())
    deadlines = Deadlines(args.token_timeout, args.itl_factor, args.first_token_timeout, args.health_timeout,
                          args.capacity_wait)
    cluster = Cluster(discovery_from_args(args), cluster_secret=resolve_secret(args.cluster_secret),
                      deadlines=deadlines, registry=registry)
    server = Server(cluster, Tokenizer(model_dir), name, ModelConfig.from_dir(model_dir).max_position_embeddings,
                    args.max_prompt_tokens, metrics=RequestMetrics(registry, name))
    ClusterCollector(cluster, name, registry)
    app = create_app(server, api_keys=keys, registry=registry)

    @app.on_event("startup")
    async def _start() -> None:
        await cluster.start()
        scheme = "https" if args.ssl_certfile else "http"
        print(f"READY router {scheme}://{args.host}:{args.port}", flush=True)

    @app.on_event("shutdown")
    async def _stop() -> None:
        await cluster.stop()

    import importlib.util
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    from router.http_protocol import OpenAIErrorH11Protocol
    uvicorn.run(app, host=args.host, port=args.port, loop=loop, log_level=args.log_level.lower(),
                http=OpenAIErrorH11Protocol,
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, access_log=False,
                timeout_graceful_shutdown=args.graceful_timeout)
    return 0
