"""RouterConfig: everything one router process is built from.

Composed, not inherited: the HTTP front end's own options, how it talks to nodes
(`ClusterOptions`), how it finds them (`DiscoveryConfig`) and its SLO planner (`PlannerConfig`).
`pdserve router` builds it once from the parsed flags (`pdserve/commands/router.py::router_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.node_runtime.discovery import DiscoveryConfig
from pdserve.engine.generation_defaults import DEFAULT_GENERATION_CONFIG
from pdserve.node_runtime.tls_options import ClusterTLSOptions
from pdserve.router.admission import DEFAULT_MAX_WAITING, check_limit
from pdserve.router.deadlines import Deadlines
from pdserve.router.http_limits import ConnectionLimits
from pdserve.router.key_limits import KeyLimits
from pdserve.router.kv_routing import ROUTING_MODES
from pdserve.router.prefill_offload import DEFAULT_SATURATED_TOKENS, OffloadPolicy
from pdserve.router.slo_planner import PlannerConfig


@dataclass(frozen=True)
class ClusterOptions(ClusterTLSOptions):
    """How the router calls nodes."""

    cluster_secret: str = ""
    """Shared secret sent on every node call (empty: none, dev only)."""
    deadlines: Deadlines = field(default_factory=Deadlines)
    routing: str = "kv-aware"
    """kv-aware: route each request to the nodes that hold most of its prompt's KV, bounded by load
    (nodes' KV events); wrr: weighted round robin on free KV only."""
    prefill_saturated_tokens: int = DEFAULT_SATURATED_TOKENS
    """A prefill node with this many prompt tokens pending is saturated: while every prefill node
    is, a decode node whose own pending prefill plus the prompt is no longer prefills the prompt
    itself (0: never)."""
    max_waiting_requests: int = DEFAULT_MAX_WAITING
    """Requests that may wait, in arrival order, for a decode node with room (each up to
    --capacity-wait); past it a new request gets 503 with Retry-After before any work."""

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_MODES)}, got {self.routing!r}")
        OffloadPolicy(self.prefill_saturated_tokens)  # ValueError when out of range
        check_limit(self.max_waiting_requests)


@dataclass(frozen=True)
class RouterConfig:
    """One router process: HTTP options + cluster + discovery + SLO planner."""

    model_dir: str | Path
    """Checkpoint directory: the router needs its tokenizer, chat template and context length."""
    served_model_name: tuple[str, ...] = ()
    """Model names clients may use (several: each is accepted and listed in /v1/models; the first
    labels the metrics; unset: the Hub id given to --model, else the model directory's name)."""
    tokenizer: str | Path | None = None
    """Tokenizer directory, or a Hub id already in the local HF cache, when not the checkpoint's
    (unset: the model's own)."""
    chat_template: str | None = None
    """A Jinja chat template, or a file holding one, used instead of the checkpoint's."""
    generation_config: str = DEFAULT_GENERATION_CONFIG
    """Sampling defaults for requests that leave a field unset: auto reads the model's
    generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as
    vLLM does; vllm ignores it; DIR reads DIR/generation_config.json (pdserve.engine.generation_defaults)."""
    enable_prompt_tokens_details: bool = True
    """Report usage.prompt_tokens_details.cached_tokens, as OpenAI does (--no-enable-prompt-tokens-details
    leaves it out, vLLM's default)."""
    max_model_len: int | None = None
    """A ceiling on the context length the nodes report (unset: theirs)."""
    host: str = "127.0.0.1"
    """Address the router binds (0.0.0.0 in a container whose port is published)."""
    port: int = 8000
    """HTTP port of the router (the OpenAI API, /health and /metrics)."""
    api_keys: tuple[str, ...] = ()
    """Accepted Bearer keys; none: the API is open."""
    key_limits: KeyLimits = field(default_factory=KeyLimits)
    """Per-key in-flight and per-minute limits (429; router/key_limits.py)."""
    ssl_certfile: str | None = None
    """HTTPS: the router's certificate (PEM; unset: plain HTTP)."""
    ssl_keyfile: str | None = None
    """HTTPS: the certificate's private key (PEM)."""
    max_prompt_tokens: int | None = None
    """Refuse longer prompts with a 400 (unset: only the model's context length bounds them)."""
    graceful_timeout: float = 30.0
    """Seconds open streams may finish after SIGTERM before they are cut."""
    log_level: str = "info"
    """Logging level of the router process: debug, info, warning or error."""
    sse_keepalive: float = 15.0
    """Seconds without a token before a stream sends an SSE keep-alive comment (`: keep-alive`)."""
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    cluster: ClusterOptions = field(default_factory=ClusterOptions)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    slo_planner: PlannerConfig = field(default_factory=PlannerConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        if any(not n for n in self.served_model_name):
            raise ValueError("--served-model-name: names must not be empty")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.sse_keepalive <= 0:
            raise ValueError(f"--sse-keepalive must be > 0, got {self.sse_keepalive}")
        self.key_limits.check_keys(self.api_keys)
