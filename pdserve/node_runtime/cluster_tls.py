"""Mutual TLS on the gRPC links between router and nodes (and decode -> prefill).

Optional: `--cluster-tls-cert/--cluster-tls-key/--cluster-tls-ca` on every process. With them, every
node serves gRPC only over TLS and demands a client certificate signed by the cluster CA, and every
caller presents its own; the cluster secret still travels, now encrypted. Without them the plaintext
path stays, for local use (`pdserve up` on 127.0.0.1).

Peers are reached by address (pod IPs change), so the server name checked is the fixed
TLS_SERVER_NAME: every certificate of the cluster carries it as a DNS subject alternative name,
and the CA, not the address, says who belongs to the cluster. `pdserve up --cluster-tls` makes a
throwaway CA and certificate (`make_throwaway`, needs the `cryptography` package).
The CacheStore KV links (tcp data, rdma control) run over mutual TLS with the same files
(`cachestore_tls`), their HMAC handshake on the cluster secret inside it.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import grpc

from pdserve.cachestore.tls import LinkTLS

TLS_SERVER_NAME = "pdserve.cluster"
"""The DNS name every cluster certificate carries and every caller checks."""


@dataclass(frozen=True)
class ClusterTLS:
    """PEM bytes of this process's certificate and key and of the cluster CA."""

    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def from_files(cls, cert: str | None, key: str | None, ca: str | None) -> "ClusterTLS | None":
        """None when no file is named (plaintext); ValueError when only some are, or one is unreadable."""
        given = [x for x in (cert, key, ca) if x]
        if not given:
            return None
        if len(given) != 3:
            raise ValueError("--cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca go together")
        try:
            return cls(*(Path(p).read_bytes() for p in (cert, key, ca)))  # type: ignore[arg-type]
        except OSError as e:
            raise ValueError(f"cannot read a cluster TLS file: {e}") from None

    def cachestore_tls(self) -> LinkTLS:
        """The same certificate, key and CA for the CacheStore TCP links (Python ssl contexts)."""
        return LinkTLS.from_pem(self.cert, self.key, self.ca, TLS_SERVER_NAME)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        creds = grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )
        return grpc.aio.secure_channel(
            address, creds, options=[*options, ("grpc.ssl_target_name_override", TLS_SERVER_NAME)]
        )


def channel(address: str, tls: ClusterTLS | None, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    """A channel to a cluster peer: mutual TLS when configured, else plaintext."""
    return tls.channel(address, options) if tls else grpc.aio.insecure_channel(address, options=options)


def add_port(server: grpc.aio.Server, address: str, tls: ClusterTLS | None) -> int:
    return server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)


def make_throwaway(directory: Path, days: int = 7) -> tuple[Path, Path, Path]:
    """A fresh CA and one certificate it signed (for every process of a local cluster: the name
    is TLS_SERVER_NAME, plus localhost and 127.0.0.1), written to `directory`: (cert, key, ca)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject: str, issuer_name, signer, public_key, ca: bool, sans=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer_name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve throwaway CA")])
    ca_cert = build("pdserve throwaway CA", ca_name, ca_key, ca_key.public_key(), True)
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(TLS_SERVER_NAME), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = build(TLS_SERVER_NAME, ca_name, ca_key, key.public_key(), False, sans)
    pem = serialization.Encoding.PEM
    paths = directory / "cluster.crt", directory / "cluster.key", directory / "ca.crt"
    paths[0].write_bytes(cert.public_bytes(pem))
    paths[1].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    paths[1].chmod(0o600)
    paths[2].write_bytes(ca_cert.public_bytes(pem))
    return paths
