"""`pdserve router`: the OpenAI-compatible HTTP front end."""

from __future__ import annotations

import argparse
import os

from pdserve.commands.generate import add_model_args


def register(subparsers: argparse._SubParsersAction) -> None:
    from pdserve.discovery import add_discovery_args
    p = subparsers.add_parser("router", help="run the OpenAI-compatible router")
    add_model_args(p)
    add_discovery_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: model dir name)")
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted Bearer key (repeatable; default: $PDSERVE_API_KEYS, comma-separated; none = open)")
    p.add_argument("--cluster-secret", default=None, help="shared node secret (default: $PDSERVE_CLUSTER_SECRET)")
    p.add_argument("--ssl-certfile", default=None)
    p.add_argument("--ssl-keyfile", default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="refuse longer prompts (400)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds open streams may finish after SIGTERM before they are cut (uvicorn)")
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
    from pdserve.runtime.auth import resolve_secret
    from pdserve.runtime.node_metrics import add_process_collectors, served_model_name
    from router.app import create_app
    from router.cluster import Cluster
    from router.cluster_metrics import ClusterCollector
    from router.request_metrics import RequestMetrics
    from router.serving import Server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    model_dir = args.model or default_model_dir()
    name = args.served_model_name or served_model_name(model_dir)
    keys = args.api_key or [k.strip() for k in os.environ.get("PDSERVE_API_KEYS", "").split(",") if k.strip()]
    registry = add_process_collectors(CollectorRegistry())
    cluster = Cluster(discovery_from_args(args), cluster_secret=resolve_secret(args.cluster_secret), registry=registry)
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
    uvicorn.run(app, host=args.host, port=args.port, loop=loop, log_level=args.log_level.lower(),
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile, access_log=False,
                timeout_graceful_shutdown=args.graceful_timeout)
    return 0
