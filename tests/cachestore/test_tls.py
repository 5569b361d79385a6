"""CacheStore over mutual TLS (issue 24, "the CacheStore handshake bound to it"): transfers are
byte-exact through TLS, nothing of the session or the KV crosses in clear, and a peer without a
cluster certificate cannot even handshake, leaving the receiver healthy and leaking nothing."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading

import pytest

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, LinkTLS, MemoryRegion, PoolGeometry, TransferError
from pdserve.cachestore.tcp_listener import TcpLimits
from pdserve.node_runtime.cluster_tls import TLS_SERVER_NAME, make_throwaway
from tests.cachestore.helpers import SECRET, block, pools, rejected, until, untouched_outside

GEO = PoolGeometry(num_layers=4, num_blocks=32, block_bytes=64 * 1024)  # frames span many TLS records
LIMITS = TcpLimits(handshake_timeout=3.0)  # the plaintext peer is cut after it


def link_tls(directory) -> LinkTLS:
    directory.mkdir()
    return LinkTLS.from_files(*map(str, make_throwaway(directory)), TLS_SERVER_NAME)


@pytest.fixture
def ours(tmp_path) -> LinkTLS:
    return link_tls(tmp_path / "ours")


@pytest.fixture
async def server(ours):
    src, dst = pools(GEO)
    srv = CacheStoreServer(
        MemoryRegion.from_buffer(dst), GEO, transport="tcp", secret=SECRET, tcp_limits=LIMITS, tls=ours
    )
    await srv.start()
    srv.test_pools = (src, dst)
    try:
        yield srv
    finally:
        await srv.stop()
    assert srv.num_sessions == 0


async def send(srv, tls: LinkTLS | None, rid: str, src_blocks: list[int], dst_blocks: list[int]) -> None:
    """One transfer of every layer with the real client; raises TransferError when refused."""
    src, _ = srv.test_pools
    client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="tcp", secret=SECRET, tls=tls)
    creds = srv.open_session(rid, dst_blocks, timeout=30)
    try:
        tx = client.open_transfer(creds)
        for layer in range(GEO.num_layers):
            tx.write_layer(layer, src_blocks)
        await tx.finish(30)
        await srv.get_session(rid).wait_complete(30)
    finally:
        srv.close_session(rid)
        await client.close()


async def test_transfer_over_tls_is_byte_exact(server, ours):
    src, dst = server.test_pools
    jobs = [(f"r{i}", [i, i + 1, 20 + i], [30 - 3 * i, 31 - 3 * i, 29 - 3 * i]) for i in range(5)]
    await asyncio.gather(*[send(server, ours, rid, s, d) for rid, s, d in jobs])
    landed = set()
    for _, s, d in jobs:
        for layer in range(GEO.num_layers):
            for a, b in zip(s, d):
                assert block(dst, GEO, layer, b) == block(src, GEO, layer, a)
                landed.add((layer, b))
    assert untouched_outside(dst, GEO, landed)


class Recorder:
    """A TCP relay between sender and receiver that keeps every byte it forwards."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.seen = bytearray()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(x, y), daemon=True).start()

    def _pipe(self, x: socket.socket, y: socket.socket) -> None:
        try:
            while data := x.recv(1 << 16):
                with self.lock:
                    self.seen += data
                y.sendall(data)
        except OSError:
            pass
        finally:
            for s in (x, y):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


async def test_nothing_crosses_in_clear(server, ours, monkeypatch):
    """The session id, token and a KV block never appear on the wire: the HMAC handshake and every
    frame run inside TLS."""
    src, _ = server.test_pools
    relay = Recorder(server.endpoint)
    monkeypatch.setattr(server, "endpoint", relay.endpoint)  # credentials point the sender at the relay
    try:
        creds = server.open_session("clear", [4], timeout=30)
        client = CacheStoreClient(MemoryRegion.from_buffer(src), GEO, transport="tcp", secret=SECRET, tls=ours)
        tx = client.open_transfer(creds)
        tx.write_layer(0, [9])
        await tx.finish(30)
        await client.close()
        server.close_session("clear")
    finally:
        relay.close()
    seen = bytes(relay.seen)
    assert len(seen) > GEO.block_bytes  # the block did go through the relay
    for secret in (bytes.fromhex(creds.session_id), bytes.fromhex(creds.token), block(src, GEO, 0, 9)[:64]):
        assert secret not in seen


def tls_client() -> ssl.SSLContext:
    """A TLS client context that trusts the receiver but presents no certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


@pytest.mark.parametrize("peer", ["no_certificate", "other_ca", "plaintext"])
async def test_peer_without_a_cluster_certificate_is_refused(server, ours, tmp_path, peer):
    before_tls, before_hs = rejected(server, "tls_handshake"), rejected(server, "handshake_timeout")
    if peer == "other_ca":  # the real client with a certificate from another CA: its transfer fails
        with pytest.raises(TransferError):
            await send(server, link_tls(tmp_path / "theirs"), "intruder", [1], [2])
        assert await until(lambda: rejected(server, "tls_handshake") > before_tls)
    elif peer == "no_certificate":

        def attack() -> bytes:
            host, port = server.endpoint.rsplit(":", 1)
            raw = socket.create_connection((host, int(port)), timeout=5)
            try:
                sock = tls_client().wrap_socket(raw, server_hostname=TLS_SERVER_NAME)
                return sock.recv(16)  # TLS 1.3: the refusal arrives at the first read
            except (ssl.SSLError, OSError):
                return b""
            finally:
                raw.close()

        assert await asyncio.to_thread(attack) == b""  # never a nonce
        assert await until(lambda: rejected(server, "tls_handshake") > before_tls)
    else:  # a plaintext sender waits for a nonce that never comes, then is cut at the deadline

        def attack() -> bytes:
            host, port = server.endpoint.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=30) as raw:
                try:
                    return raw.recv(16)
                except OSError:
                    return b""

        assert await asyncio.to_thread(attack) == b""
        assert await until(lambda: rejected(server, "handshake_timeout") > before_hs)
    _, dst = server.test_pools
    assert untouched_outside(dst, GEO, set())  # nothing landed
    assert await until(lambda: server._listener.num_connections == 0)  # nothing left open
    assert server.num_sessions == 0
    await send(server, ours, "after", [3], [5])  # and the receiver still serves cluster peers
    src, dst = server.test_pools
    assert block(dst, GEO, 2, 5) == block(src, GEO, 2, 3)


async def test_rdma_control_connections_run_over_tls(ours, tmp_path, monkeypatch):
    """The rdma transport's TCP control connections (QP exchange, grants) take the same TLS: a
    transfer over the emulated verbs device works with it, and a sender of another CA cannot even
    exchange QPs."""
    from pdserve.cachestore import rdma

    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    geo = PoolGeometry(num_layers=2, num_blocks=8, block_bytes=1024)
    src, dst = pools(geo)
    srv = CacheStoreServer(MemoryRegion.from_buffer(dst), geo, transport="rdma", secret=SECRET, tls=ours)
    await srv.start()
    try:
        for tls, rid in ((ours, "member"), (link_tls(tmp_path / "theirs"), "intruder")):
            client = CacheStoreClient(MemoryRegion.from_buffer(src), geo, transport="rdma", secret=SECRET, tls=tls)
            creds = srv.open_session(rid, [5, 6], timeout=30)
            try:
                tx = client.open_transfer(creds)
                for layer in range(geo.num_layers):
                    tx.write_layer(layer, [1, 2])
                if tls is ours:
                    await tx.finish(30)
                    await srv.get_session(rid).wait_complete(30)
                else:
                    with pytest.raises(TransferError):
                        await tx.finish(30)
            finally:
                srv.close_session(rid)
                await client.close()
        assert block(dst, geo, 1, 6) == block(src, geo, 1, 2)
        assert await until(lambda: rejected(srv, "tls_handshake", "rdma") >= 1)
    finally:
        await srv.stop()


async def test_refused_handshakes_leak_no_descriptor(server, ours):
    """30 peers refused at the TLS handshake (no certificate, or not TLS at all): every descriptor
    the receiver opened for them is closed again, and it still serves cluster peers."""
    import os

    await send(server, ours, "warm", [1], [1])  # the listener's own descriptors exist already
    before = len(os.listdir("/proc/self/fd"))
    host, port = server.endpoint.rsplit(":", 1)

    def attack(i: int) -> None:
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            try:
                if i % 2:
                    raw.sendall(b"GET / HTTP/1.1\r\n\r\n" * 20)  # not a TLS ClientHello
                    raw.recv(16)
                else:
                    tls_client().wrap_socket(raw, server_hostname=TLS_SERVER_NAME).recv(16)
            except (ssl.SSLError, OSError):
                pass

    await asyncio.to_thread(lambda: [attack(i) for i in range(30)])
    assert await until(lambda: rejected(server, "tls_handshake") >= 30)
    assert await until(lambda: server._listener.num_connections == 0)
    assert await until(lambda: len(os.listdir("/proc/self/fd")) <= before)
    await send(server, ours, "after", [2], [3])
