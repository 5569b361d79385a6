"""Mutual TLS for the CacheStore TCP links (the tcp transport's data path and the rdma transport's
control connections).

Optional: without a `LinkTLS` the links stay plaintext, guarded only by the HMAC handshake on the
cluster secret (local use). With one, the receiver wraps every accepted socket and demands a client
certificate that chains to the cluster CA, and the sender checks the receiver's certificate against
the same CA under the fixed `server_name` (peers are reached by address, pod IPs change). The TLS
handshake completes before the receiver sends its nonce, so a peer without a cluster certificate
never reaches the HMAC handshake, and the session tokens in frame headers travel encrypted.

The contexts are built here from PEM files or bytes handed in from above (the node runtime's
`--cluster-tls-*` files): this package is the ground floor and knows nothing of the node's flags.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkTLS:
    """The two ends' SSL contexts of one process: `server` for the receiver's listener, `client`
    for the sender's connections, `server_name` the name the sender checks."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    server_name: str

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str, server_name: str) -> "LinkTLS":
        """Contexts for this process's certificate and key, trusting only the CA in `ca` (PEM files)."""
        server = _context(ssl.PROTOCOL_TLS_SERVER, cert, key, ca)
        client = _context(ssl.PROTOCOL_TLS_CLIENT, cert, key, ca)
        return cls(server, client, server_name)

    @classmethod
    def from_pem(cls, cert: bytes, key: bytes, ca: bytes, server_name: str) -> "LinkTLS":
        """The same from PEM bytes. `ssl` loads a certificate chain only from a file, so certificate
        and key go through an anonymous in-memory file (memfd), never onto a disk."""
        with _pem_file(cert + b"\n" + key) as chain:
            return cls(
                _context(ssl.PROTOCOL_TLS_SERVER, chain, None, ca),
                _context(ssl.PROTOCOL_TLS_CLIENT, chain, None, ca),
                server_name,
            )

    def wrap_client(self, sock):
        """`sock`, connected to a receiver, after a TLS handshake that verified it (blocking)."""
        return self.client.wrap_socket(sock, server_hostname=self.server_name)

    def wrap_server(self, sock):
        """An accepted socket wrapped for the receiver; the handshake is left to the caller's poller."""
        return self.server.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)


def _context(protocol: int, cert: str, key: str | None, ca: str | bytes) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED  # both ways: a peer without a cluster certificate is refused
    if isinstance(ca, bytes):
        ctx.load_verify_locations(cadata=ca.decode())
    else:
        ctx.load_verify_locations(cafile=ca)
    ctx.load_cert_chain(cert, key)
    # After the handshake no TLS control record may flow on its own (no TLS 1.2 renegotiation, no
    # TLS 1.3 session tickets: nothing resumes these long-lived connections), so the sender's send
    # thread and ack thread each only ever write or only ever read the connection's TLS state.
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    if protocol == ssl.PROTOCOL_TLS_SERVER:
        ctx.num_tickets = 0
    return ctx


class _pem_file:
    """A readable path holding `data` for as long as the `with` lasts (memfd where Linux has it)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.fd = -1
        self.dir: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> str:
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("pdserve-tls")
            os.write(self.fd, self.data)
            return f"/proc/self/fd/{self.fd}"
        self.dir = tempfile.TemporaryDirectory()
        path = os.path.join(self.dir.name, "chain.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(self.data)
        return path

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        if self.dir is not None:
            self.dir.cleanup()
