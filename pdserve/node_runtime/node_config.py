"""NodeConfig: everything one prefill or decode node process is built from.

Composed, not inherited: the engine's own options (`EngineConfig`), the node's process options
(`NodeOptions`), how KV moves (`TransferOptions`) and how the node registers (`DiscoveryConfig`).
`pdserve prefill|decode` build it once from the parsed flags (`node_common.node_config`); tests
build it directly, e.g. with the in-process `local` transport that the CLI does not offer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdserve.cachestore.transport import TRANSPORTS
from pdserve.engine.config import EngineConfig
from pdserve.node_runtime.discovery import DiscoveryConfig
from pdserve.node_runtime.tls_options import ClusterTLSOptions

RDMA_ENV = {
    "rdma_device": "PDSERVE_RDMA_DEVICE",
    "rdma_port": "PDSERVE_RDMA_PORT",
    "rdma_gid_index": "PDSERVE_RDMA_GID_INDEX",
    "rdma_qps": "PDSERVE_RDMA_QPS",
}
"""TransferOptions field -> the variable CacheStore's RDMA setup reads (see `export_env`)."""


DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 64
"""Set by `benchmarks/multiturn.py` (docs/benchmark-log.md, "Multi-turn chat", 2026-11-26): on a chat's later
turns the decode node lacks the user's turn and the previous answer (36-66 tokens on the bench
workload); prefilling those locally took TTFT p50 on turns >= 2 from 2.13 s (threshold 16: a
PreparePull, a pull, a Prefill round trip and a delta transfer) to 0.54 s, 0.38x `vllm serve`'s,
with no KV on the wire. An idle prefill node was about as fast as local up to 64 tokens
(`benchmarks/local_prefill.py`), and 64 tokens is about one decode step of compute, so a local
prefill of that size barely holds up the node's running streams. On a second workload (`multiturn.py
--workload docs`: 90-330 lacking tokens) it tied `vllm serve` and 256 was faster (BENCHMARKS.md)."""

DEFAULT_KV_PULL_MIN_BLOCKS = 1
"""Set by `benchmarks/local_prefill.py --pull` (docs/benchmark-log.md, "D->P pull vs recompute"): on the bench
model a pulled block costs a few ms where recomputing it costs tens, so a pull pays from one block."""


ROLE_ENGINE_DEFAULTS: dict[str, dict[str, object]] = {
    "prefill": {"max_num_batched_tokens": 8192},  # prompts up to this size run in one step
    "decode": {"preemption": "never"},  # a decode node never drops KV to make room: it refuses admission
}
"""Where a node role departs from EngineConfig's defaults (a flag still overrides them)."""
ROLE_PORTS = {"prefill": 50061, "decode": 50071}
"""Each role's default gRPC port, so that one of each runs on a host without flags."""


def role_defaults(field: str) -> str:
    """EngineConfig.`field`'s default on each node role, as a flag's help states it."""
    return ", ".join(
        f"{ROLE_ENGINE_DEFAULTS[role].get(field, getattr(EngineConfig, field))} on {role} nodes"
        for role in ROLE_ENGINE_DEFAULTS
    )


@dataclass(frozen=True)
class NodeOptions(ClusterTLSOptions):
    """Process-level options of a node (the engine's own live in EngineConfig)."""

    host: str = "127.0.0.1"
    """Address the gRPC server (and a decode node's CacheStore listener) binds (0.0.0.0 in containers)."""
    port: int = 0
    """gRPC port (0: pick a free one)."""
    metrics_port: int = 0
    """Prometheus /metrics port (0: off)."""
    cluster_secret: str = ""
    """Shared secret on gRPC calls and CacheStore connections (empty: no authentication, dev only)."""
    drain_timeout: float = 30.0
    """Seconds in-flight requests may finish after SIGTERM."""
    advertise_host: str | None = None
    """Host others use to reach this node, which a decode node also puts in its KV credentials (unset:
    $POD_IP, else --host, or the hostname if --host is a wildcard)."""
    colocated: bool = False
    """Accepted for compatibility: a decode node always prefills a request that names no prefill node."""
    kv_reuse: bool = True
    """Cache-aware disaggregation. Decode node: share the cached prefix blocks of a remote-prefill
    request, transfer only the missing ones, and prefill locally when the missing part is short.
    Prefill node: serve prompts from its own prefix cache. Off: every block is computed and shipped
    (the baseline before reuse across the split)."""
    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    """Decode node with kv_reuse: prefill here, not on a prefill node, when the prompt tokens this
    node lacks are at most this many (0: only when no prefill node is usable)."""
    kv_pull_min_blocks: int = DEFAULT_KV_PULL_MIN_BLOCKS
    """Decode node with kv_reuse: send a remote-prefill request's held prefix blocks to the prefill
    node (D->P pull, `decode_node.kv_pull`) when it lacks at least this many of them, instead of
    letting it recompute them (0: never pull)."""
    log_level: str = "INFO"
    """Logging level of the node process: DEBUG, INFO, WARNING or ERROR."""
    served_model_name: tuple[str, ...] = ()
    """The served model names, as the router's; the node labels its metrics with the first (unset: the
    Hub id given to --model, else the model directory's name)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.kv_pull_min_blocks < 0:
            raise ValueError(f"--kv-pull-min-blocks must be >= 0, got {self.kv_pull_min_blocks}")


@dataclass(frozen=True)
class TransferOptions:
    """How this node's KV cache moves (CacheStore)."""

    transport: str = "tcp"
    """CacheStore transport for KV: tcp, rdma, auto (RDMA if a device exists, else tcp) or local
    (both ends in one process; tests only)."""
    kv_timeout: float = 60.0
    """Seconds a KV transfer / session may take."""
    peer_timeout: float = 10.0
    """Seconds a peer may leave a gRPC keepalive ping unanswered before its calls fail (a partitioned
    or frozen host); bounds a decode node's wait on a prefill node well below kv_timeout."""
    cachestore_port: int = 0
    """CacheStore listener port (0: pick a free one): a decode node receives prompt KV there, a
    prefill node the held prefix blocks of D->P pulls."""
    rdma_device: str | None = None
    """RDMA device (NIC) name, e.g. mlx5_0 (None: $PDSERVE_RDMA_DEVICE, else the first device)."""
    rdma_port: int | None = None
    """Port number on the RDMA device (None: $PDSERVE_RDMA_PORT, else 1)."""
    rdma_gid_index: int | None = None
    """GID index for RoCE (None: $PDSERVE_RDMA_GID_INDEX, else 0)."""
    rdma_qps: int | None = None
    """RC queue pairs per receiver, used round robin (None: $PDSERVE_RDMA_QPS, else 2)."""

    def __post_init__(self) -> None:
        if self.peer_timeout <= 0:
            raise ValueError(f"--peer-timeout must be > 0, got {self.peer_timeout}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        for name, least in (("rdma_port", 1), ("rdma_gid_index", 0), ("rdma_qps", 1)):
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")

    def export_env(self) -> None:
        """Hand the RDMA settings to CacheStore, which reads them from the environment when it sets
        up RDMA (it imports nothing from pdserve); a setting left None keeps the variable as it is."""
        for name, env in RDMA_ENV.items():
            value = getattr(self, name)
            if value is not None:
                os.environ[env] = str(value)


@dataclass(frozen=True)
class NodeConfig:
    """One node process: engine + node + transfer + discovery options."""

    engine: EngineConfig
    node: NodeOptions = field(default_factory=NodeOptions)
    transfer: TransferOptions = field(default_factory=TransferOptions)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
