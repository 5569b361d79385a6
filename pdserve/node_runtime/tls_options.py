"""The --cluster-tls-* options, shared by node and router configs (node_runtime.cluster_tls
does the TLS; this module stays import-light for the CLI)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.node_runtime.cluster_tls import ClusterTLS


@dataclass(frozen=True)
class ClusterTLSOptions:
    """Files for mutual TLS on cluster gRPC: all three, or none (plaintext)."""

    cluster_tls_cert: str | None = None
    """This process's certificate (PEM) for cluster gRPC and CacheStore (unset: plaintext)."""
    cluster_tls_key: str | None = None
    """Its private key (PEM)."""
    cluster_tls_ca: str | None = None
    """The cluster CA (PEM): peers must present a certificate it signed."""

    def __post_init__(self) -> None:
        if len([x for x in (self.cluster_tls_cert, self.cluster_tls_key, self.cluster_tls_ca) if x]) not in (0, 3):
            raise ValueError("--cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca go together")

    def tls(self) -> ClusterTLS | None:
        """The loaded ClusterTLS, or None for plaintext (ValueError: a file cannot be read)."""
        from pdserve.node_runtime.cluster_tls import ClusterTLS

        return ClusterTLS.from_files(self.cluster_tls_cert, self.cluster_tls_key, self.cluster_tls_ca)
